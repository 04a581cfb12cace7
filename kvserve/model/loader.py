"""Load a local Hugging Face checkpoint directory into a `DecoderLM`."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvserve.config import ModelConfig
from kvserve.core.errors import ModelLoadError
from kvserve.gguf.reader import open_gguf
from kvserve.gguf.source import gguf_source
from kvserve.gguf.weights import read_gguf_weights
from kvserve.model.block_linear import BlockEmbedding, BlockLinear
from kvserve.model.block_weights import BlockWeight, as_quantized_tensor
from kvserve.model.decoder import DecoderLM
from kvserve.model.kernel_table import apply_kernel_choice
from kvserve.model.linear import apply_weight_scheme
from kvserve.model.qlinear import QuantLinear, kernel_summary
from kvserve.model.registry import get_arch
from kvserve.quant.calibrated import calibrated_at_load
from kvserve.quant.convert import artifact_tensors, concat_rows
from kvserve.quant.methods import DEFAULT_METHOD
from kvserve.quant.rtn import QuantizedTensor
from kvserve.quant.scheme import (
    GGUF_ACTIVATION_ACTS,
    QuantizationError,
    WeightScheme,
    parse_weight_scheme,
)

# Our fused parameter <- the checkpoint's tensors, concatenated along the output dimension.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        extra = (
            " (found pytorch_model.bin: convert it to safetensors)"
            if any(model_dir.glob("*.bin"))
            else ""
        )
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights{extra}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: weight shards listed in the index are missing: {missing}"
        )
    return files


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    from kvserve.progress import progress

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for name in progress(names, len(names), f"loading {path.name}"):
                    if not name.endswith(_IGNORED_SUFFIXES):
                        tensors[name] = f.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {exc}") from None
    return tensors


def _checkpoint_names(param_name: str) -> list[str]:
    """Checkpoint tensor names that make up one of our parameters (HF names keep the `model.` prefix)."""
    for fused, parts in _FUSED.items():
        if f".{fused}." in param_name:
            return [param_name.replace(fused, part) for part in parts]
    return [param_name]


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    max_positions: int,
    dtype: str = "float32",
    device: str = "cpu",
    quantization: WeightScheme | str | None = None,
    quantization_method: str = DEFAULT_METHOD,
    calib: str | None = None,
    gguf_activations: str = "fp32",
    kernel_choice: str = "own",
) -> DecoderLM:
    """The checkpoint's DecoderLM on `device`; `quantization` (a scheme, `EngineConfig.weight_scheme`,
    or for a direct caller its string; docs/quantization.md)
    quantises its weights at load and runs them on the integer kernels: rounded to nearest, or the
    block linears by a calibrated `quantization_method` (gptq, awq, smoothquant) on the text in
    `calib`, as `kvserve quantize` would write them, short scale groups allowed. `gguf_activations`
    "int8" / "int8x2" run a GGUF file's blocks on the panel kernel (install_block_weights).
    `kernel_choice` (config.KERNEL_CHOICES) picks each linear's GEMM per row count on CPU
    (model/kernel_table.py); "own", the default here, keeps kvserve's kernels and fixed rules.

    Long: the load stages in order (read, check, calibrate, install, convert), which share the state
    dict being consumed."""
    model_dir = Path(model_dir)
    scheme = parse_weight_scheme(quantization) if isinstance(quantization, str) else quantization
    quantization = None if scheme is None else scheme.name
    arch = get_arch(config.model_type)
    with torch.device("meta"):
        model = DecoderLM(config, arch, max_positions)
    gguf_file = gguf_source(model_dir)
    if gguf_activations != "fp32" and (gguf_file is None or quantization is not None):
        raise QuantizationError(
            f"--gguf-activations {gguf_activations} runs a GGUF file's own blocks: "
            + (
                "drop --quantization"
                if gguf_file is not None
                else f"{model_dir} is not a GGUF model"
            )
        )
    if gguf_file is None:
        checkpoint, blocks = read_checkpoint(model_dir), {}
    else:  # the file's blocks run as they are unless --quantization asks to requantise them
        checkpoint, blocks = read_gguf_checkpoint(
            gguf_file, config, dtype, quantization, quantization_method
        )
    artifact = artifact_tensors(model_dir, checkpoint)  # a quantised checkpoint's codes, apart
    if artifact is not None and quantization is not None:
        raise QuantizationError(
            f"{model_dir} is already quantised (quantization_config in config.json): drop "
            f"--quantization {quantization}"
        )
    asks_bf16 = scheme is not None and scheme.runs_bf16
    if torch.device(device).type == "cpu" and dtype in ("bfloat16", "float16") and not asks_bf16:
        # vLLM users reach for --dtype bfloat16 for speed; here it takes the per-op torch path
        logger.warning(
            "--dtype %s on CPU runs every op in %s through torch, without kvserve's fused kernels "
            "(slower than fp32: 0.7x at saturation on a Zen 4); for bf16 speed keep the default "
            "dtype and use --quantization linear=bf16,head=bf16 (bf16 products, fp32 elsewhere)",
            dtype,
            dtype,
        )
    if scheme is not None and quantization_method != DEFAULT_METHOD:
        # the block linears' codes, and the checkpoint with AWQ / SmoothQuant's scales folded
        artifact, checkpoint = calibrated_at_load(
            model_dir, checkpoint, scheme, quantization_method, calib
        )
        scheme = replace(scheme, linear=None)  # the head and the table: rounded below
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    used: set[str] = set()
    expected = model.state_dict()
    codes = artifact or {}
    views: set[int] = set()  # data pointers of parameters left as views of the file
    for name, meta_tensor in expected.items():
        sources = [_hf_name(n) for n in _checkpoint_names(name)]
        absent = [s for s in sources if s not in checkpoint and s not in codes and s not in blocks]
        if absent:
            missing.extend(absent)
            continue
        if any(s in blocks for s in sources):  # GGUF blocks: a BlockLinear replaces it below
            state[name] = _block_stand_in(
                model, name, [blocks.get(s) for s in sources], meta_tensor
            )
            used.update(sources)
            continue
        if any(s in codes for s in sources):
            tensor = _quantized_stand_in(model, name, [codes.get(s) for s in sources], sources)
            if tensor.is_meta:  # a linear's weight: its QuantLinear replaces it below
                _check_shape(model_dir, sources, tensor, meta_tensor)
                state[name] = tensor
                used.update(sources)
                continue
        else:
            tensor = (
                torch.cat([checkpoint[s] for s in sources])
                if len(sources) > 1
                else checkpoint[sources[0]]
            )
        _check_shape(model_dir, sources, tensor, meta_tensor)
        loaded = tensor.to(dtype=TORCH_DTYPES[dtype], device=device)
        if loaded.data_ptr() == tensor.data_ptr():
            # a view of the memory-mapped file. One such view keeps the whole mapping, and every
            # page read from it while loading, resident (515 MB of RSS for the 540 MB
            # SmolLM2-135M-shaped fp32 checkpoint): copy the norms, biases and an untied table
            # now; the CPU layouts below copy the linears and a tied table anyway.
            if _copied_by_cpu_layout(model, name):
                views.add(loaded.data_ptr())
            else:
                loaded = loaded.clone()
        state[name] = loaded
        used.update(sources)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ModelLoadError(f"{model_dir}: checkpoint is missing tensors: {shown}")
    if config.tie_word_embeddings and "lm_head.weight" in checkpoint:
        used.add(
            "lm_head.weight"
        )  # a tied checkpoint may still store the head; it equals the embedding
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True, assign=True)
    # inference only: with grad on, quantising at load recorded an autograd graph from each
    # QuantLinear's scales back to the fp32 weight it came from, and kept every such weight alive
    model.requires_grad_(False)
    # Buffers (rotary cos/sin) were on meta: rebuild them for real.
    model.build_rotary(device)
    if artifact:
        install_artifact_linears(model, artifact, device)
        log_kernels(model, str(model_dir))
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:  # a quantised weight whose module is not a linear kvserve can run quantised
            raise ModelLoadError(f"{model_dir}: no quantised kernel for {left[:4]}")
    if blocks:
        install_block_weights(model, blocks, gguf_activations)
        log_kernels(model, f"GGUF {gguf_file.name}")
    if scheme is not None and (scheme.is_quantized or scheme.runs_bf16):
        apply_weight_scheme(model, scheme)
        log_kernels(model, quantization)
    unused = sorted(set(checkpoint) - used)
    # The model holds the tensors now: drop this function's references before the CPU layouts are
    # built, so each original is freed as its layer is converted (otherwise the peak holds the
    # checkpoint, the packed copies and the panels of the whole model at once).
    state.clear()
    checkpoint = None
    if torch.device(device).type == "cpu":
        model.use_cpu_weights()
    table = getattr(model.embed_tokens, "weight", None)
    if (
        isinstance(table, torch.Tensor) and table.data_ptr() in views
    ):  # tied, quantised head: no panels
        model.embed_tokens.weight = nn.Parameter(table.detach().clone(), requires_grad=False)
    if torch.device(device).type == "cpu":
        model.kernel_table = apply_kernel_choice(model, kernel_choice)  # for /manifest
    if unused:
        logger.warning(
            "%s: ignoring %d checkpoint tensors not used by %s: %s",
            model_dir,
            len(unused),
            config.model_type,
            ", ".join(unused[:5]),
        )
    return model.eval()


def read_gguf_checkpoint(
    path: Path, config: ModelConfig, dtype: str, quantization: str | None, method: str
) -> tuple[dict[str, torch.Tensor], dict[str, BlockWeight]]:
    """A GGUF file's float tensors and its quantised matrices' blocks, by Hugging Face name; with
    `quantization`, every tensor dequantised to fp32 (for the requantising path below)."""
    if dtype != "float32":
        raise ModelLoadError(
            f"{path}: a GGUF model runs with fp32 activations (--dtype float32); for bf16 products "
            "requantise it with --quantization linear=bf16,head=bf16"
        )
    if quantization is not None and method != DEFAULT_METHOD:
        raise QuantizationError(
            f"{path}: --quantization-method {method} calibrates a Hugging Face directory; a GGUF "
            "file can be requantised by rounding to nearest (rtn) only"
        )
    tensors = read_gguf_weights(
        open_gguf(path), config.num_heads, config.num_kv_heads, keep_blocks=quantization is None
    )
    floats = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    return floats, {n: t for n, t in tensors.items() if isinstance(t, BlockWeight)}


def _block_stand_in(
    model: DecoderLM, name: str, parts: list[BlockWeight | None], meta_tensor: torch.Tensor
) -> torch.Tensor:
    """What the float state dict holds for a parameter made of GGUF blocks: a meta tensor for a
    linear's weight or the embedding table (`install_block_weights` puts block modules in their
    place). A fused weight whose parts are not all blocks is refused (no file seen has one)."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if all(p is not None for p in parts):
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if shape != tuple(meta_tensor.shape) or any(p.shape[1] != shape[1] for p in parts):
            raise ModelLoadError(
                f"{name}: the GGUF tensors have shapes {[tuple(p.shape) for p in parts]}, the "
                f"metadata implies {tuple(meta_tensor.shape)}"
            )
        if attr == "weight" and (isinstance(owner, nn.Linear) or owner is model.embed_tokens):
            return torch.empty(shape, device="meta")
    raise ModelLoadError(
        f"{name}: mixes quantised and float GGUF tensors, which kvserve cannot run"
    )


def install_block_weights(
    model: DecoderLM, blocks: dict[str, BlockWeight], gguf_activations: str = "fp32"
) -> None:
    """Replace each linear whose weights are GGUF blocks by a BlockLinear of them (q, k, v and gate,
    up stacked as the float loader fuses them), the table by a BlockEmbedding, and a tied head by a
    BlockLinear over the table's own blocks (one copy). With `gguf_activations` "int8", a linear
    whose blocks are one of kvserve's integer formats (block_weights.PANEL_FORMATS) runs on the panel
    kernel instead, its activations rounded to int8 per 32 inputs as llama.cpp rounds them; "int8x2"
    the same with the remainder of that rounding rounded again (ACT_BLOCK2: KL 1.5e-5 from the exact
    path on SmolLM2, docs/gguf.md)."""
    act = GGUF_ACTIVATION_ACTS.get(gguf_activations)  # None: fp32, the file's blocks as they are
    exact_types: set[str] = set()  # with act: the types left on the fp32 block kernel

    def block_layer(parts: list[BlockWeight], bias: torch.Tensor | None) -> nn.Module:
        qt = None if act is None else as_quantized_tensor(parts, act)
        if qt is None and act is not None:
            exact_types.update(p.ggml_type for p in parts)
        return BlockLinear(parts, bias) if qt is None else QuantLinear(qt, bias)

    table = blocks.pop("model.embed_tokens.weight", None)
    if table is not None:
        model.embed_tokens = BlockEmbedding(table)
        if model.config.tie_word_embeddings:
            model.cpu_head, model.lm_head = block_layer([table], None), None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        sources = [_hf_name(n) for n in _checkpoint_names(f"{name}.weight")]
        if not any(s in blocks for s in sources):
            continue
        layer = block_layer([blocks.pop(s) for s in sources], module.bias)
        if name == "lm_head":
            model.cpu_head, model.lm_head = layer, None
        else:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    if exact_types:
        # the block kernel's sums change with a step's row count, and rounding the next linear's
        # activations magnifies that: Gemma 3 Q4_K_M with int8 changed greedy tokens with batching
        # (max |dlogp| 0.8), with int8x2 log probabilities moved 2.4e-3 (fp32: 4.6e-5)
        logger.warning(
            "--gguf-activations %s: the %s matrices have no integer panel format and stay on the "
            "fp32 block kernel, so outputs depend on what else a step batches (docs/determinism.md; "
            "--gguf-activations fp32 keeps them batch-invariant)",
            gguf_activations,
            ", ".join(sorted(exact_types)),
        )


def _copied_by_cpu_layout(model: DecoderLM, name: str) -> bool:
    """Whether `use_cpu_weights` copies this parameter into a kernel layout (a linear's weight, and
    a tied embedding, which is the head's weight) and drops it: no copy of its own is needed first."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if isinstance(owner, nn.Linear) and attr == "weight":
        return True
    return owner is model.embed_tokens and model.config.tie_word_embeddings


def _check_shape(
    model_dir: Path, sources: list[str], tensor: torch.Tensor, meta_tensor: torch.Tensor
) -> None:
    if tensor.shape != meta_tensor.shape:
        raise ModelLoadError(
            f"{model_dir}: tensor {sources} has shape {tuple(tensor.shape)}, expected "
            f"{tuple(meta_tensor.shape)} from config.json"
        )


def _quantized_stand_in(
    model: DecoderLM, name: str, parts: list[QuantizedTensor | None], sources: list[str]
) -> torch.Tensor:
    """What the float state dict holds for a parameter whose checkpoint tensors are quantised: for a
    linear's weight, a meta tensor of its shape (no memory: `install_artifact_linears` puts a
    QuantLinear of the codes in its place, so the fp32 model is never materialised); for anything
    else, the dequantised fp32 weight."""
    if any(p is None for p in parts):
        raise ModelLoadError(f"{name}: some of {sources} are quantised and some are not")
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if isinstance(owner, torch.nn.Linear) and attr == "weight":
        rows = sum(p.shape[0] for p in parts)
        return torch.empty(rows, parts[0].shape[1], device="meta")  # [out, in]
    return torch.cat([p.dequantize() for p in parts])


def log_kernels(model: DecoderLM, scheme_name: str) -> None:
    """Say which kernel runs each quantised linear, loudly when a slower one stands in."""
    kernels = kernel_summary(model)
    logger.info("quantization %s: %s", scheme_name, kernels)
    slow = {k: n for k, n in kernels.items() if k.startswith("dequantized") or k.endswith("scalar")}
    if any(k.endswith("avx2") for k in kernels):
        from kvserve.model import fused_decode

        if "avx512" not in fused_decode.available_isas():
            logger.info(
                "quantization %s: the integer kernels run on AVX2: this CPU (or compiler) has no "
                "AVX-512 VNNI, whose kernels are faster for prefill and batches (see /manifest)",
                scheme_name,
            )
    if slow:
        logger.warning(
            "quantization %s: %d linears run on a slower stand-in kernel %s (see /manifest)",
            scheme_name,
            sum(slow.values()),
            sorted(slow),
        )


def install_artifact_linears(
    model: DecoderLM, artifact: dict[str, QuantizedTensor], device: str
) -> None:
    """Replace each linear whose checkpoint tensors are quantised by a QuantLinear of those codes
    (q, k, v and gate, up fused as the float loader fuses them)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        sources = [_hf_name(n) for n in _checkpoint_names(f"{name}.weight")]
        present = [s in artifact for s in sources]
        if not any(present):
            continue
        if not all(present):
            raise ModelLoadError(f"{name}: some of {sources} are quantised and some are not")
        qt = concat_rows([artifact.pop(s) for s in sources])  # popped: each freed once packed
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = QuantLinear(qt, module.bias, device)
        if name == "lm_head":
            model.cpu_head, model.lm_head = layer, None
        else:
            setattr(parent, attr, layer)
