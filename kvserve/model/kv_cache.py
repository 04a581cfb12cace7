"""Paged KV tensors of one layer, in the model's dtype or quantised to 8 bits (docs/performance.md).

A token at position p of a request lives in slot block_ids[p // block_size] * block_size + p % block_size of
`k` and `v` [num_blocks, block_size, num_kv_heads, head_dim].

8-bit caches (`kv_cache_dtype` int8 or fp8 = e4m3) store one code per value and one fp16 scale per
(token, kv head): value = code * scale, scale = max |value| of that head's vector / the code's largest
magnitude (127, or 448 for e4m3). Scales are rounded to fp16 before the codes are computed, so the stored
pair is exactly what the writer meant. Bytes per value: 1 + 2 / head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_CODE_MAX = {"int8": 127.0, "fp8": 448.0}
_SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class LayerKVCache:
    """One layer's cache. kind "float": k, v hold values in the model dtype; "int8" / "fp8": k, v hold
    uint8 codes and k_scale, v_scale [num_blocks, block_size, num_kv_heads] their fp16 scales."""

    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    kind: str = "float"
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantised(self) -> bool:
        return self.kind != "float"

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] -> cache slots [T]."""
        _, _, num_kv_heads, head_dim = self.k.shape
        if not self.quantised:
            self.k.view(-1, num_kv_heads, head_dim)[slots] = k
            self.v.view(-1, num_kv_heads, head_dim)[slots] = v
            return
        for values, codes, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            code, scale = quantise(values, self.kind)
            codes.view(-1, num_kv_heads, head_dim)[slots] = code
            scales.view(-1, num_kv_heads)[slots] = scale

    def gather(
        self, block_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `block_ids` [...] as `dtype`: [..., block_size, num_kv_heads, head_dim]
        (a copy; 8-bit caches are dequantised). index_select, not indexing: about half the time of
        advanced indexing for the few blocks of a prompt chunk (a prefill makes two per layer)."""

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, block_ids.reshape(-1)).view(*block_ids.shape, *t.shape[1:])

        if not self.quantised:
            return rows(self.k), rows(self.v)
        return (
            dequantise(rows(self.k), rows(self.k_scale), self.kind, dtype),
            dequantise(rows(self.v), rows(self.v_scale), self.kind, dtype),
        )


def quantise(values: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., head_dim] -> (uint8 codes [..., head_dim], fp16 scales [...])."""
    values = values.float()
    code_max = _CODE_MAX[kind]
    # fp16 subnormals keep tiny vectors' scales; an all-zero vector gets the smallest one (codes 0).
    scale = (values.abs().amax(dim=-1) / code_max).clamp_min(2**-24).to(_SCALE_DTYPE)
    scaled = (values / scale.float().unsqueeze(-1)).clamp(-code_max, code_max)
    if kind == "int8":
        scaled = scaled.round()
    return scaled.to(_CODE_DTYPES[kind]).view(torch.uint8), scale


def dequantise(
    codes: torch.Tensor, scales: torch.Tensor, kind: str, dtype: torch.dtype
) -> torch.Tensor:
    """uint8 codes [..., head_dim] and fp16 scales [...] -> values [..., head_dim] in `dtype`."""
    values = codes.view(_CODE_DTYPES[kind]).float() * scales.float().unsqueeze(-1)
    return values.to(dtype)


def kv_bytes_per_value(kv_cache_dtype: str, dtype_bytes: int, head_dim: int) -> float:
    """Cache bytes per K or V element, scales included."""
    if kv_cache_dtype == "auto":
        return dtype_bytes
    return 1 + _SCALE_DTYPE.itemsize / head_dim


def allocate_layers(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
) -> tuple[list[torch.Tensor], list[LayerKVCache]]:
    """The backing tensors (their bytes are the cache's size) and one `LayerKVCache` view per layer."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == "auto":
        cache = torch.zeros(shape, dtype=dtype, device=device)
        return [cache], [LayerKVCache(layer[0], layer[1]) for layer in cache]
    if kv_cache_dtype not in _CODE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    codes = torch.zeros(shape, dtype=torch.uint8, device=device)
    scales = torch.ones(shape[:-1], dtype=_SCALE_DTYPE, device=device)
    layers = [
        LayerKVCache(c[0], c[1], kv_cache_dtype, s[0], s[1])
        for c, s in zip(codes, scales, strict=True)
    ]
    return [codes, scales], layers
