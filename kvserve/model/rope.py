"""Rotary position embeddings (rotate-half convention, as Hugging Face's Llama), with rope-scaling variants."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvserve.config import ModelConfig
from kvserve.core.errors import UnsupportedModelError


def _default(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    return inv_freq / float(params["factor"])


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
}


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position up to `max_positions`; applied to flat [T, heads, head_dim]."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        device: torch.device | str = "cpu",
        local: bool = False,
    ):
        """`local`: the sliding-window layers' RoPE (config.rope_local_*), else the global one."""
        super().__init__()
        self.theta = config.rope_local_theta if local else config.rope_theta
        self.scaling = dict(config.rope_local_scaling if local else config.rope_scaling)
        rope_type = str(self.scaling.get("rope_type", "default"))
        if rope_type not in ROPE_SCALINGS:
            raise UnsupportedModelError(
                f"rope scaling {rope_type!r} is not supported (supported: {sorted(ROPE_SCALINGS)})"
            )
        self.rope_type = rope_type
        self.config = config
        self.max_positions = max_positions
        self.build(device)

    def build(self, device: torch.device | str) -> None:
        """(Re)compute the cos/sin tables on `device` (after loading a model built on the meta device)."""
        config = self.config
        dim = config.head_dim
        # Explicit devices: the model may be constructed under a `torch.device("meta")` context.
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        inv_freq = 1.0 / (self.theta**exponents)
        inv_freq = ROPE_SCALINGS[self.rope_type](inv_freq, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions [T], each [T, 1, head_dim / 2]: gathered once per step and
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim]
    cos, sin = rope
    num_heads = q.shape[1]
    rotated = _rotate(torch.cat([q, k], dim=1), cos, sin)  # one pass over q and k heads together
    return rotated[:, :num_heads], rotated[:, num_heads:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
