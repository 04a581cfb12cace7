"""A GGUF file's metadata as a Hugging Face config, and its tensors under Hugging Face names.

llama.cpp names a model's facts `<arch>.<key>` and its tensors `blk.N.attn_q.weight`; kvserve's model
code is keyed on Hugging Face's `config.json` and tensor names. `GGUF_ARCHITECTURES` says, per GGUF
architecture, which `model_type` it is and how llama.cpp's converter changed the tensors on the way in
(`convert_hf_to_gguf.py`), so that the loader can undo it exactly as transformers' own GGUF loader
does (the oracle, docs/gguf.md):

- llama: the rows of q and k are permuted per head (llama.cpp's rotary pairs adjacent values, Hugging
  Face's the two halves of a head); `unpermute_rows` gives the row order back. A row permutation keeps
  every quantised block whole, so the file's blocks are used as they are.
- gemma3: every norm weight was stored plus 1 (llama.cpp multiplies by the weight, Gemma's RMSNorm by
  1 + weight); the loader subtracts it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvserve.core.errors import ModelLoadError, UnsupportedModelError
from kvserve.gguf.reader import GGUFFile


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture maps onto a Hugging Face `model_type`."""

    model_type: str
    permuted_qk: bool = False  # llama.cpp's converter permuted the q and k rows
    norm_shift: float = 0.0  # subtracted from every norm weight (Gemma stores 1 + w)
    layer_norms: tuple[tuple[str, str], ...] = (
        ("attn_norm", "input_layernorm"),
        ("ffn_norm", "post_attention_layernorm"),
    )


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", permuted_qk=True),
    "qwen2": GGUFArch("qwen2"),
    "qwen3": GGUFArch("qwen3"),
    "gemma3": GGUFArch(
        "gemma3_text",
        norm_shift=1.0,
        layer_norms=(
            ("attn_norm", "input_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
        ),
    ),
}

# llama.cpp's per-layer tensor names -> Hugging Face's, below `model.layers.N.`
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_arch(gguf: GGUFFile) -> GGUFArch:
    name = gguf.architecture
    if name not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.path}: GGUF architecture {name!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return GGUF_ARCHITECTURES[name]


def _required(gguf: GGUFFile, key: str) -> object:
    value = gguf.arch_key(key)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: the metadata has no {gguf.architecture}.{key}")
    return value


def _positive_int(gguf: GGUFFile, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(
            f"{gguf.path}: {gguf.architecture}.{key} must be a positive integer, got {value!r}"
        )
    return value


def hf_config(gguf: GGUFFile) -> dict:
    """The `config.json` a Hugging Face checkpoint of this model would carry (fp32 weights)."""
    arch = gguf_arch(gguf)

    def arch_int(key: str, default: object = None) -> int:
        value = gguf.arch_key(key, default)
        return _positive_int(gguf, key, _required(gguf, key) if value is None else value)

    if gguf.arch_key("rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in (
        gguf.tensors
    ):
        raise UnsupportedModelError(
            f"{gguf.path}: RoPE scaling ({gguf.arch_key('rope.scaling.type', 'rope_freqs')}) in a "
            "GGUF file is not supported yet; use the Hugging Face directory of this model"
        )
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{gguf.path}: the metadata has no tokenizer.ggml.tokens")
    hidden = arch_int("embedding_length")
    num_heads = arch_int("attention.head_count")
    num_kv_heads = arch_int("attention.head_count_kv", num_heads)
    head_dim = arch_int("attention.key_length", hidden // num_heads)
    eps = gguf.arch_key("attention.layer_norm_rms_epsilon", 1e-5)
    config = {
        "model_type": arch.model_type,
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "num_hidden_layers": arch_int("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": arch_int("feed_forward_length"),
        "rms_norm_eps": float(eps),
        "rope_theta": float(gguf.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": arch_int("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "torch_dtype": "float32",
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = gguf.metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and 0 <= value < len(tokens):
            config[hf_key] = value
    if arch.model_type == "gemma3_text":
        config.update(_gemma3_config(gguf, config))
    return config


def _gemma3_config(gguf: GGUFFile, config: dict) -> dict:
    """Gemma 3's extra facts. The file carries the window; the rest are Gemma 3's defaults, as
    llama.cpp (which hard-codes them for this architecture) and transformers' GGUF loader assume."""
    window = _positive_int(
        gguf, "attention.sliding_window", _required(gguf, "attention.sliding_window")
    )
    pattern = 6  # every sixth layer attends globally (llama.cpp: hparams.set_swa_pattern(6))
    return {
        "sliding_window": window,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(config["num_hidden_layers"])
        ],
        "query_pre_attn_scalar": config["head_dim"],
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def hf_tensor_name(gguf_name: str, arch: GGUFArch) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a tensor kvserve
    does not use."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _MODEL_TENSORS:
        return f"{_MODEL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, kind = parts[1], parts[2]
    hf = _LAYER_TENSORS.get(kind) or dict(arch.layer_norms).get(kind)
    return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: hf[i] = gguf[order[i]].

    The converter wrote gguf = hf.reshape(heads, 2, d/2, ...).swapaxes(1, 2): Hugging Face row
    (h, half, j) sits at llama.cpp row (h, j, half)."""
    head_dim = num_rows // num_heads
    gguf_rows = np.arange(num_rows).reshape(num_heads, head_dim // 2, 2)
    return gguf_rows.swapaxes(1, 2).reshape(-1)


def generation_config(config: dict) -> dict:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
