"""Round-to-nearest quantisation of a weight matrix, and its exact dequantisation (docs/quantization.md).

Symmetric with b bits: q_max = 2^(b-1) - 1, s = max|w| / q_max, q = clamp(round(w / s), -q_max, q_max).
Zero-point: the range is widened to hold 0 (as GPTQ and AWQ do), s = (max - min) / (2^b - 1),
z = round(-min / s), q = clamp(round(w / s) + z, 0, 2^b - 1). A constant-zero group (s = 0) gets s = 1
and codes 0. Scales and zero-points are rounded to fp16 first and the codes are computed from the
rounded scale, so `dequantize` reproduces exactly what the kernels multiply by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.quant.scheme import TensorScheme

_FP16_TINY = 2.0**-24  # smallest positive fp16: a non-zero scale never rounds to 0


@dataclass(frozen=True)
class QuantizedTensor:
    """Integer codes and fp16 scales (and zero-points) of a [num_rows, num_cols] weight.

    codes: int8 [num_rows, num_cols] (signed when symmetric, 0..2^b-1 with a zero-point);
    scales, zeros: fp16 [num_rows, num_groups] (one column for per-channel, [1, 1] per tensor).
    """

    scheme: TensorScheme
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group_len(self) -> int:
        return self.scheme.group_len(self.codes.shape[1])

    def expanded(self, per_group: torch.Tensor) -> torch.Tensor:
        """[rows, groups] (or [1, 1]) -> [rows, cols], each group's value repeated over its columns."""
        num_rows, num_cols = self.codes.shape
        full = per_group.float().expand(num_rows, -1)
        return full.repeat_interleave(self.group_len, dim=1)[:, :num_cols]

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols]: s * q, or s * (q - z) with a zero-point."""
        codes = self.codes.float()
        if self.zeros is not None:
            codes = codes - self.expanded(self.zeros)
        return codes * self.expanded(self.scales)

    @property
    def num_bits(self) -> int:
        return self.scheme.num_bits(*self.codes.shape)


def _grouped(weight: torch.Tensor, group_len: int) -> torch.Tensor:
    """[rows, cols] -> [rows, groups, group_len], a short last group padded by repeating its last
    column (so it changes no min, max or absmax)."""
    num_rows, num_cols = weight.shape
    num_groups = math.ceil(num_cols / group_len)
    pad = num_groups * group_len - num_cols
    if pad:
        weight = torch.cat([weight, weight[:, -1:].expand(num_rows, pad)], dim=1)
    return weight.reshape(num_rows, num_groups, group_len)


def _to_fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale.clamp(min=_FP16_TINY), torch.ones_like(scale)).half()


def group_ranges(weight: torch.Tensor, scheme: TensorScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (min, max) of `weight` [rows, cols] -> two [rows, groups] tensors ([1, 1] per tensor)."""
    weight = weight.float()
    if scheme.granularity == "tensor":
        return weight.min().reshape(1, 1), weight.max().reshape(1, 1)
    grouped = _grouped(weight, scheme.group_len(weight.shape[1]))
    return grouped.amin(dim=2), grouped.amax(dim=2)


def scales_for(
    weight: torch.Tensor, scheme: TensorScheme, clip: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp16 (scales, zeros) per group of `weight` [rows, cols]; `clip` shrinks the range (AWQ/GPTQ
    clipping search)."""
    low, high = group_ranges(weight, scheme)
    if scheme.zero_point:
        low = torch.clamp(low * clip, max=0.0)
        high = torch.clamp(high * clip, min=0.0)
        scale = _to_fp16_scale((high - low) / (2**scheme.bits - 1))
        zeros = torch.round(-low / scale.float()).clamp(0, 2**scheme.bits - 1).half()
        return scale, zeros
    q_max = 2 ** (scheme.bits - 1) - 1
    absmax = torch.maximum(low.abs(), high.abs()) * clip
    return _to_fp16_scale(absmax / q_max), None


def quantize_with(
    weight: torch.Tensor, scheme: TensorScheme, scales: torch.Tensor, zeros: torch.Tensor | None
) -> QuantizedTensor:
    """Round `weight` [rows, cols] to codes under given fp16 scales (and zero-points)."""
    probe = QuantizedTensor(scheme, torch.empty(weight.shape, dtype=torch.int8), scales, zeros)
    scaled = weight.float() / probe.expanded(scales)
    if zeros is None:
        q_max = 2 ** (scheme.bits - 1) - 1
        codes = torch.round(scaled).clamp(-q_max, q_max)
    else:
        codes = (torch.round(scaled) + probe.expanded(zeros)).clamp(0, 2**scheme.bits - 1)
    return QuantizedTensor(scheme, codes.to(torch.int8).contiguous(), scales, zeros)


def quantize(weight: torch.Tensor, scheme: TensorScheme) -> QuantizedTensor:
    """Round-to-nearest quantisation of `weight` [rows, cols] in `scheme`."""
    if scheme.is_float:
        raise ValueError(f"{scheme.name} is a float format, not a quantisation")
    scales, zeros = scales_for(weight, scheme)
    return quantize_with(weight, scheme, scales, zeros)
