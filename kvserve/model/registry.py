"""Supported architectures, keyed by the checkpoint's `model_type`."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.errors import UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture differs from plain Llama."""

    name: str
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # RMSNorm weights stored as an offset from 1, applied in fp32: x_hat * (1 + w) (Gemma)
    offset_norms: bool = False
    # a norm after attention and after the MLP too, before each joins the residual (Gemma 2 / 3)
    sandwich_norms: bool = False
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    # model/fused_decode.py computes Llama's layer (csrc/decode_step.c): only for these
    fused_decode: bool = True
    tensor_parallel: bool = True  # model/parallel.py shards its layers
    # config.json keys that must be present (and not null) for this architecture
    required_config: tuple[str, ...] = ()


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("llama"),
        ArchSpec("mistral"),
        ArchSpec("qwen2", qkv_bias=True),
        ArchSpec("qwen3", qk_norm=True),
        ArchSpec(
            "gemma3_text",
            qk_norm=True,
            offset_norms=True,
            sandwich_norms=True,
            embed_scale=True,
            fused_decode=False,
            tensor_parallel=False,
            required_config=("layer_types", "rope_local_theta", "query_pre_attn_scalar"),
        ),
    )
}


def get_arch(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
