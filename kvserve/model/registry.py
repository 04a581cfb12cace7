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


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("llama"),
        ArchSpec("mistral"),
        ArchSpec("qwen2", qkv_bias=True),
        ArchSpec("qwen3", qk_norm=True),
    )
}


def get_arch(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
