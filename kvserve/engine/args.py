"""Every engine option, once (`EngineArgs`), -> `EngineConfig`; and the checkpoint's tokenizer and stop
tokens.

`EngineArgs` is the one definition of each option: its name, type, default and help. `kvserve serve`,
`kvserve generate` and `kvserve bench latency` generate their engine flags from it (`add_cli_args`,
`from_cli_args`); `LLM(model, **options)` and `build_engine_config(model, **options)` validate their
keyword arguments with it. A new option is one new field here.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from kvserve.config import (
    ADMISSION_POLICIES,
    ATTENTION_BACKENDS,
    DTYPE_BYTES,
    GGUF_ACTIVATIONS,
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    THREAD_POLICIES,
    CacheConfig,
    DistConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.core.errors import InvalidRequestError, ModelLoadError
from kvserve.memory import (
    KV_CACHE_MEMORY_FRACTION,
    auto_kv_cache_bytes,
    checkpoint_bytes,
    device_memory_reading,
)
from kvserve.models import resolve_model
from kvserve.options import format_bytes, parse_bytes
from kvserve.quant.methods import METHODS
from kvserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

MODEL_HELP = (
    "model directory, GGUF file, or a built-in name: smollm2-135m-instruct, kvserve-demo, "
    "kvserve-demo-draft"
)
DTYPES = ("auto", *sorted(DTYPE_BYTES))


def _default(config_class, name: str):
    """The default of a config dataclass's field: an engine option that is also a config field takes
    its default from there, so each default is written once (kvserve/config.py)."""
    return next(f.default for f in fields(config_class) if f.name == name)


def _option(
    default,
    help: str,
    *,
    type: type = str,
    optional: bool = False,
    choices: tuple | None = None,
    flag: str | None = None,
    parse=None,
    metavar: str | None = None,
    group: str = "engine",
    cli: bool = True,
):
    """A field of `EngineArgs` with what its command-line flag needs. `type` is the value's type
    (`optional`: None is allowed too); `parse` turns the flag's text into it (default: `type`)."""
    meta = dict(
        help=help,
        type=type,
        optional=optional,
        choices=choices,
        flag=flag,
        parse=parse,
        metavar=metavar,
        group=group,
        cli=cli,
    )
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineArgs:
    """The engine's options, validated on construction (types and choices here; ranges in the config
    dataclasses that `create_engine_config` builds)."""

    model: str | None = _option(
        None,
        MODEL_HELP + " (default: smollm2-135m-instruct)",
        optional=True,
        metavar="MODEL",
        cli=False,
    )
    dtype: str = _option(
        "auto",
        "compute dtype; auto: fp32 on CPU, the checkpoint's bf16/fp16 on CUDA",
        choices=DTYPES,
    )
    device: str = _option("cpu", "cpu, cuda or cuda:N")
    max_model_len: int | None = _option(
        None,
        "context length in tokens, prompt + output (default: the model's limit)",
        type=int,
        optional=True,
    )
    max_num_seqs: int = _option(
        _default(SchedulerConfig, "max_num_seqs"), "most sequences running at once", type=int
    )
    max_num_batched_tokens: int = _option(
        _default(SchedulerConfig, "max_num_batched_tokens"),
        "token budget of one step, shared by decode tokens and prompt chunks",
        type=int,
    )
    max_prompt_tokens_beside_decode: int = _option(
        _default(SchedulerConfig, "max_prompt_tokens_beside_decode"),
        "prompt tokens a step may hold while it also holds decoding rows (0: the whole budget)",
        type=int,
    )
    block_size: int = _option(
        _default(CacheConfig, "block_size"), "tokens per KV-cache block", type=int
    )
    num_blocks: int | None = _option(
        None,
        "KV-cache blocks (default: as many as --kv-cache-memory holds)",
        type=int,
        optional=True,
    )
    kv_cache_memory_bytes: int | None = _option(
        None,
        "memory for the KV cache, e.g. 512MiB, 2GiB, or bytes (default: auto, "
        f"{KV_CACHE_MEMORY_FRACTION * 100:.0f}%% of the memory available after the weights, at most what "
        "--max-num-seqs full-length sequences use; docs/operations.md)",
        type=int,
        optional=True,
        flag="--kv-cache-memory",
        parse=parse_bytes,
        metavar="SIZE",
    )
    enable_prefix_caching: bool = _option(
        True,
        "reuse cached prompt prefixes",
        type=bool,
        flag="--prefix-caching",
    )
    hybrid_kv_cache: bool = _option(
        True,
        "a model with sliding-window and global layers (Gemma 3) returns the blocks its "
        "window layers no longer see (docs/scheduling.md)",
        type=bool,
    )
    admission: str = _option(
        _default(SchedulerConfig, "admission"),
        "on_demand: charge blocks as used, preempt when full; reserve: prompt + max_tokens "
        "up front (docs/scheduling.md)",
        choices=ADMISSION_POLICIES,
    )
    seed: int = _option(0, "engine random seed", type=int)
    quantization: str | None = _option(
        None,
        "quantise weights at load: int8, int4-g128, w8a8, linear=bf16,head=bf16 (bf16 products, "
        "fp32 sums), linear=int4-g64,head=int8, ... "
        "(docs/quantization.md)",
        optional=True,
    )
    quantization_method: str = _option(
        _default(EngineConfig, "quantization_method"),
        "how --quantization quantises the block linears: rtn (round to nearest), or gptq, awq, "
        "smoothquant on the calibration text of --calib (the head and table: rtn)",
        choices=tuple(METHODS),
    )
    calib: str | None = _option(
        None,
        "calibration text for --quantization-method: .jsonl with a text field, or plain text",
        optional=True,
        metavar="FILE",
    )
    gguf_activations: str = _option(
        _default(EngineConfig, "gguf_activations"),
        "a GGUF model's products: fp32 (its blocks times fp32 activations, the reference) or int8 "
        "(Q4_0, Q4_1, Q5_0, Q8_0 blocks on the integer panel kernel, activations rounded to int8 per "
        "32 inputs as llama.cpp does: faster; docs/gguf.md)",
        choices=GGUF_ACTIVATIONS,
    )
    kv_cache_dtype: str = _option(
        "auto",
        "KV cache storage: the model's dtype, or 8-bit codes + fp16 scales per token and head",
        choices=KV_CACHE_DTYPES,
    )
    attention_backend: str = _option(
        "auto",
        "auto: the in-place C kernels on CPU with fp32 weights; torch: torch ops only",
        choices=ATTENTION_BACKENDS,
    )
    thread_policy: str = _option(
        _default(EngineConfig, "thread_policy"),
        "adaptive: on CPU, steps use one thread fewer while a neighbour takes CPU time from "
        "the engine's threads, trying the full count again now and then; fixed: always "
        'torch\'s thread count (docs/performance.md "Threads")',
        choices=THREAD_POLICIES,
    )
    grammar_compile_timeout: float = _option(
        _default(EngineConfig, "grammar_compile_timeout_s"),
        "seconds a structured-output grammar may compile; past it the compile is stopped and its "
        "request gets a 400 (docs/structured-output.md)",
        type=float,
    )
    tensor_parallel_size: int = _option(
        _default(EngineConfig, "tensor_parallel_size"),
        "shard the model over N ranks (worker processes; gloo on CPU, NCCL on CUDA; "
        "docs/parallel.md)",
        type=int,
    )
    nnodes: int = _option(
        _default(DistConfig, "nnodes"),
        "hosts the tensor-parallel ranks span; node 0 runs the engine, the others `kvserve tp-node` "
        "(SGLang's spelling; docs/parallel.md)",
        type=int,
        group="multi-host tensor parallelism",
    )
    node_rank: int = _option(
        _default(DistConfig, "node_rank"),
        "this host's index, 0 to --nnodes - 1 (0: the engine)",
        type=int,
        group="multi-host tensor parallelism",
    )
    dist_init_addr: str | None = _option(
        None,
        "node 0's HOST:PORT: node 0 listens there (on HOST only) for the other nodes, which must "
        "prove the shared secret ($KVSERVE_DIST_SECRET or --dist-secret-file)",
        optional=True,
        metavar="HOST:PORT",
        group="multi-host tensor parallelism",
    )
    dist_timeout: float = _option(
        _default(DistConfig, "timeout_s"),
        "seconds every node has to join, and that a collective across hosts waits for a rank",
        type=float,
        group="multi-host tensor parallelism",
    )
    dist_secret_file: str | None = _option(
        None,
        "file holding the nodes' shared secret (default: $KVSERVE_DIST_SECRET)",
        optional=True,
        metavar="FILE",
        group="multi-host tensor parallelism",
    )
    speculative_model: str | None = _option(
        None,
        "draft model directory or built-in name (kvserve-demo-draft); same tokenizer",
        optional=True,
        group="speculative decoding",
    )
    speculative_method: str | None = _option(
        None,
        "draft model or n-gram lookup (default: draft when --speculative-model is given)",
        optional=True,
        choices=SPECULATIVE_METHODS,
        group="speculative decoding",
    )
    num_speculative_tokens: int = _option(
        4, "gamma: proposals per step", type=int, group="speculative decoding"
    )
    ngram_min: int = _option(1, "shortest n-gram to match", type=int, group="speculative decoding")
    ngram_max: int = _option(4, "longest n-gram to match", type=int, group="speculative decoding")

    def __post_init__(self) -> None:
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if isinstance(value, Path) and meta["type"] is str:
                object.__setattr__(self, f.name, value := str(value))
            if value is None and meta["optional"]:
                continue
            kind = meta["type"]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, value := float(value))  # 2 means 2.0 s
            # bool is an int in Python: refuse True for a count, and 1 for a switch
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise InvalidRequestError(
                    f"engine option {f.name} must be {kind.__name__}"
                    f"{' or None' if meta['optional'] else ''}, got {value!r}",
                    f.name,
                )
            if meta["choices"] is not None and value not in meta["choices"]:
                raise InvalidRequestError(
                    f"engine option {f.name} must be one of {meta['choices']}, got {value!r}",
                    f.name,
                )

    @classmethod
    def from_options(cls, model=None, **options) -> EngineArgs:
        """`EngineArgs(model=model, **options)`, with an unknown name a clear error, not a TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s) {unknown}; the options are {sorted(known - {'model'})}",
                unknown[0],
            )
        return cls(model=model, **options)

    # --- the command line -------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add every engine flag (all but the model, which each command spells its own way) to
        `parser`, in argument groups, with the defaults and help defined above."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in fields(cls):
            meta = f.metadata
            if not meta["cli"]:
                continue
            group = groups.get(meta["group"]) or groups.setdefault(
                meta["group"], parser.add_argument_group(meta["group"])
            )
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            if meta["type"] is bool:
                group.add_argument(
                    flag,
                    dest=f.name,
                    action=argparse.BooleanOptionalAction,
                    default=f.default,
                    help=meta["help"],
                )
                continue
            group.add_argument(
                flag,
                dest=f.name,
                type=meta["parse"] or meta["type"],
                default=f.default,
                choices=meta["choices"],
                metavar=meta["metavar"],
                help=meta["help"],
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model=None) -> EngineArgs:
        """The options `add_cli_args` parsed into `args`, with the command's model."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.metadata["cli"]}
        return cls(model=model, **values)

    def options(self) -> dict:
        """Every option but the model, by name (manifests, reports)."""
        values = asdict(self)
        values.pop("model")
        return values

    # --- the engine's configuration ---------------------------------------------------------------

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model (a built-in name or a directory), read its config, build `EngineConfig`."""
        _check_device(self.device)
        model_dir = resolve_model(self.model)
        model = ModelConfig.from_dir(model_dir)
        limit = model.max_position_embeddings
        if model.caps_context_at_window and model.sliding_window < limit:
            # Within the window, sliding-window attention is full attention: cap the context to stay exact.
            limit = model.sliding_window
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise InvalidRequestError(
                f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens",
                "max_model_len",
            )
        speculative = self._speculative_config(model_dir)
        config = EngineConfig(
            model_dir=str(model_dir),
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                hybrid=self.hybrid_kv_cache,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_prompt_tokens_beside_decode=self.max_prompt_tokens_beside_decode,
                max_model_len=max_model_len,
                admission=self.admission,
                num_lookahead_tokens=speculative.num_speculative_tokens if speculative else 0,
            ),
            dtype=resolve_dtype(self.dtype, self.device, model),
            device=self.device,
            seed=self.seed,
            speculative=speculative,
            attention_backend=self.attention_backend,
            quantization=self.quantization,
            quantization_method=self.quantization_method,
            calib=self.calib,
            gguf_activations=self.gguf_activations,
            tensor_parallel_size=self.tensor_parallel_size,
            thread_policy=self.thread_policy,
            grammar_compile_timeout_s=self.grammar_compile_timeout,
            dist=DistConfig(
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                init_addr=self.dist_init_addr,
                timeout_s=self.dist_timeout,
                secret_file=self.dist_secret_file,
            ),
        )
        return replace(config, cache=self._sized_cache(config))

    def _sized_cache(self, config: EngineConfig) -> CacheConfig:
        """The cache config with its byte budget and how it was chosen: --num-blocks, else
        --kv-cache-memory, else from this machine's memory (kvserve/memory.py)."""
        cache = config.cache
        if self.num_blocks is not None:
            return replace(cache, sizing=f"--num-blocks {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None:
            return replace(
                cache,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                sizing=f"--kv-cache-memory {format_bytes(self.kv_cache_memory_bytes)}",
            )
        size = auto_kv_cache_bytes(
            device_memory_reading(self.device),
            weights_bytes=_weights_bytes(config),
            kv_bytes_per_token=config.kv_bytes_per_token,
            block_size=cache.block_size,
            max_model_len=config.scheduler.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
        )
        return replace(cache, kv_cache_memory_bytes=size.num_bytes, sizing="auto: " + size.reason)

    def _speculative_config(self, model_dir: Path) -> SpeculativeConfig | None:
        if self.speculative_model is None and self.speculative_method is None:
            return None
        method = self.speculative_method or "draft"
        draft = draft_dir = None
        if method == "draft":
            if self.speculative_model is None:
                raise InvalidRequestError(
                    "speculative method 'draft' needs --speculative-model DIR", "speculative_model"
                )
            draft_dir = resolve_model(self.speculative_model, role="draft model")
            draft = ModelConfig.from_dir(draft_dir)
            check_same_vocabulary(model_dir, draft_dir)
        elif self.speculative_model is not None:  # never silently ignored
            raise InvalidRequestError(
                f"--speculative-model is for --speculative-method draft, not {method}",
                "speculative_model",
            )
        return SpeculativeConfig(
            method=method,
            num_speculative_tokens=self.num_speculative_tokens,
            draft_model_dir=str(draft_dir) if draft else None,
            draft_model=draft,
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
        )


def _weights_bytes(config: EngineConfig) -> int:
    """About what the weights will take once loaded: the files' bytes, widened when a 16-bit float
    checkpoint runs in fp32 (quantised checkpoints and formats: their file size)."""
    total = 0
    for model_dir, model in ((config.model_dir, config.model), _draft(config)):
        if model_dir is None:
            continue
        num_bytes = checkpoint_bytes(model_dir)
        stored = DTYPE_BYTES.get(model.torch_dtype, DTYPE_BYTES[config.dtype])
        if config.quantization is None and DTYPE_BYTES[config.dtype] > stored:
            num_bytes = num_bytes * DTYPE_BYTES[config.dtype] // stored
        total += num_bytes
    return total


def _draft(config: EngineConfig) -> tuple[str | None, ModelConfig | None]:
    spec = config.speculative
    if spec is None or spec.draft_model is None:
        return None, None
    return spec.draft_model_dir, spec.draft_model


# device types torch knows that kvserve does not run on (the rest are not devices at all)
_OTHER_DEVICE_TYPES = ("mps", "xpu", "xla", "meta", "hip", "hpu", "ipu", "mtia", "lazy", "vulkan")
_DEVICE = re.compile(r"([a-z]+)(?::(\d+))?")


def _check_device(device: str) -> None:
    """cpu, cuda or cuda:N that this torch can use, checked before the model loads. Torch is imported only for a CUDA device: the
    API process builds this configuration, and on CPU it never loads torch (docs/design.md)."""
    match = _DEVICE.fullmatch(device)
    kind = match.group(1) if match else None
    if kind not in ("cpu", "cuda", *_OTHER_DEVICE_TYPES):
        raise InvalidRequestError(
            f"--device {device!r} is not a device: use cpu, cuda or cuda:N", "device"
        )
    if kind not in ("cpu", "cuda"):
        raise InvalidRequestError(f"--device {device!r}: kvserve runs on cpu or cuda", "device")
    if kind == "cuda":
        import torch

        index = None if match.group(2) is None else int(match.group(2))
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (index is not None and index >= count):
            raise InvalidRequestError(
                f"--device {device!r}: this machine's torch sees {count} CUDA device(s)", "device"
            )


def resolve_dtype(dtype: str, device: str, model: ModelConfig) -> str:
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return model.torch_dtype if model.torch_dtype in ("bfloat16", "float16") else "bfloat16"
    return "float32"  # bf16/fp16 matmuls are far slower than fp32 on CPUs without native support


def build_engine_config(model_dir: str | Path | None = None, **options) -> EngineConfig:
    """`EngineArgs.from_options(model_dir, **options).create_engine_config()`."""
    return EngineArgs.from_options(model_dir, **options).create_engine_config()


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """A draft must map every token id to the same token as the target: compare whole vocabularies
    (token -> id, special tokens included), not their sizes."""
    target, draft = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    if target is None or draft is None:
        missing = target_dir if target is None else draft_dir
        raise ModelLoadError(
            f"{missing} has no tokenizer, so the draft's vocabulary cannot be checked against the target's"
        )
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t
            for t in set(target_vocab) | set(draft_vocab)
            if target_vocab.get(t) != draft_vocab.get(t)
        )
        raise ModelLoadError(
            f"the draft model's tokenizer ({draft_dir}) maps ids to tokens differently from the target's "
            f"({len(differing)} tokens differ, e.g. {differing[:3]}); a draft must share the tokenizer"
        )
