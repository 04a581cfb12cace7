"""GGUF quantised matrices as kvserve weights: `BlockWeight`, repacked once at load.

Every supported ggml type stores, per group of `group_len` inputs of a row, values
`scale * c (+ bias)` with `c` a small signed integer. `repack` splits a GGUF tensor's raw blocks into
that form, with the scales and biases computed in fp32 exactly as ggml's reference
(`gguf.quants.<type>.dequantize_blocks`) computes them, so `dequantize` is bit-exact against
`gguf.quants.dequantize`: one fp32 product `scale * c`, then (types with a bias) one fp32 sum.

    type   group  c               scale          bias           codes
    Q4_0   32     q - 8           d              -              nibbles (q), code_offset 8
    Q4_1   32     q               d              m              nibbles
    Q5_0   32     q - 16          d              -              int8
    Q5_1   32     q               d              m              int8
    Q8_0   32     q (int8)        d              -              int8
    Q4_K   32     q               d * sc         -(dmin * m)    nibbles
    Q5_K   32     q               d * sc         -(dmin * m)    int8
    Q6_K   16     q - 32          d * sc (int8)  -              int8

The layout is the native kernel's (kvserve/model/csrc/blocks.c): nibble codes hold a group of 32 in 16
bytes, byte j = c_j | c_{j+16} << 4 (stored unsigned: c = nibble - code_offset); int8 codes hold
one c per byte. Repacked weights take more memory than the GGUF blocks (Q4_1: 6 bits per weight
instead of 5; Q5_0 and Q6_K: about 9 and 10 instead of 5.5 and 6.6) in exchange for a kernel that
decodes every type with one loop. F32/F16/BF16 tensors are not block weights: `float_tensor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvserve.gguf.source import PANEL_FORMATS

NIBBLE_GROUP_LEN = 32  # nibble codes pack a group of 32: byte j holds elements j and j + 16


class UnsupportedQuantizationError(ValueError):
    """A GGUF tensor type that BlockWeight cannot hold."""

    def __init__(self, ggml_type: str) -> None:
        super().__init__(
            f"GGUF tensor type {ggml_type} is not supported as a block weight; supported: "
            f"{', '.join(SUPPORTED_TYPES)} (and {', '.join(FLOAT_TYPES)} via float_tensor)"
        )
        self.ggml_type = ggml_type


@dataclass(frozen=True)
class BlockWeight:
    """A repacked GGUF matrix [num_rows N, num_cols K]: W[n, k] = scales[n, g] * c[n, k] (+ biases[n, g])
    with g = k // group_len and c = codes (int8) or the nibble minus `code_offset`."""

    ggml_type: str
    num_cols: int
    codes: torch.Tensor  # [N, K / 2] uint8 nibbles, or [N, K] int8
    scales: torch.Tensor  # [N, G] fp32, G = K / group_len
    biases: torch.Tensor | None  # [N, G] fp32
    group_len: int
    code_offset: int = 0  # nibbles only: c = nibble - code_offset

    def __post_init__(self) -> None:
        num_rows = self.codes.shape[0]
        if self.num_cols % self.group_len:
            raise ValueError(f"{self.num_cols} columns are not whole groups of {self.group_len}")
        width = self.num_cols // 2 if self.nibble else self.num_cols
        if self.codes.shape != (num_rows, width) or not self.codes.is_contiguous():
            raise ValueError(
                f"codes {tuple(self.codes.shape)} are not contiguous [{num_rows}, {width}]"
            )
        if self.nibble and self.group_len != NIBBLE_GROUP_LEN:
            raise ValueError(f"nibble codes need groups of {NIBBLE_GROUP_LEN}")
        num_groups = self.num_cols // self.group_len
        for name, t in (("scales", self.scales), ("biases", self.biases)):
            if t is None:
                continue
            if (
                t.dtype != torch.float32
                or t.shape != (num_rows, num_groups)
                or not t.is_contiguous()
            ):
                raise ValueError(f"{name} must be contiguous fp32 [{num_rows}, {num_groups}]")

    @property
    def nibble(self) -> bool:
        return self.codes.dtype == torch.uint8

    @property
    def num_rows(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.num_cols)

    @property
    def num_groups(self) -> int:
        return self.num_cols // self.group_len

    @property
    def bytes(self) -> int:
        """Memory held (codes, scales and biases)."""
        tensors = (self.codes, self.scales) + (() if self.biases is None else (self.biases,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def code_values(self) -> torch.Tensor:
        """[N, K] int8: the integers c."""
        if not self.nibble:
            return self.codes
        low = (self.codes & 0x0F).view(self.num_rows, -1, NIBBLE_GROUP_LEN // 2)
        high = (self.codes >> 4).view(self.num_rows, -1, NIBBLE_GROUP_LEN // 2)
        nibbles = torch.cat((low, high), dim=2).view(self.num_rows, self.num_cols)
        return nibbles.to(torch.int8) - self.code_offset

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32, bit for bit gguf.quants.dequantize: fl(fl(scale * c) + bias)."""
        grouped = self.code_values().float().view(self.num_rows, self.num_groups, self.group_len)
        values = grouped * self.scales.unsqueeze(2)  # [N, G, group_len]
        if self.biases is not None:
            values = values + self.biases.unsqueeze(2)
        return values.view(self.num_rows, self.num_cols)

    def select_rows(self, index: torch.Tensor) -> BlockWeight:
        """The rows `index` (a permutation, a slice's indices, any int64 [R]) as a new BlockWeight."""
        return BlockWeight(
            ggml_type=self.ggml_type,
            num_cols=self.num_cols,
            codes=self.codes[index].contiguous(),
            scales=self.scales[index].contiguous(),
            biases=None if self.biases is None else self.biases[index].contiguous(),
            group_len=self.group_len,
            code_offset=self.code_offset,
        )

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), K] fp32 of the rows `ids` (an embedding lookup), without dequantising the rest."""
        return self.select_rows(ids.reshape(-1)).dequantize()


# --- repacking: raw GGUF blocks [N, blocks per row, type bytes] -> (c, scale, bias) -------------------

Unpacked = tuple[
    np.ndarray, np.ndarray, np.ndarray | None
]  # c [N, K] int, scale [N, G], bias [N, G]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[N, nb] fp32 of the fp16 field at byte `start` of every block."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] its bits 0..31."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> Unpacked:
    return _nibbles32(b[..., 2:18]).astype(np.int8) - 8, _f16(b, 0), None


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles32(b[..., 4:20]).astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> Unpacked:
    q = _nibbles32(b[..., 6:22]) | (_high_bits32(b[..., 2:6]) << 4)
    return q.astype(np.int8) - 16, _f16(b, 0), None


def _q5_1(b: np.ndarray) -> Unpacked:
    q = _nibbles32(b[..., 8:24]) | (_high_bits32(b[..., 4:8]) << 4)
    return q.astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Unpacked:
    return np.ascontiguousarray(b[..., 2:34]).view(np.int8), _f16(b, 0), None


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, nb, 12] 6-bit packed scales and mins -> ([N, nb, 8], [N, nb, 8]) (ggml's get_scale_min_k4)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per group of 32, scale d * sc and bias -(dmin * m), each one fp32 product."""
    sc, mn = _k_scale_min(b[..., 4:16])
    scale = _f16(b, 0)[..., None] * sc.astype(np.float32)
    bias = -(_f16(b, 2)[..., None] * mn.astype(np.float32))
    return scale.reshape(b.shape[0], -1), bias.reshape(b.shape[0], -1)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[N, nb, 128] -> [N, nb, 256]: chunk i of 32 bytes holds group 2i (low) and 2i + 1 (high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (chunks & 0x0F).reshape(*qs.shape[:-1], 256)


def _q4_k(b: np.ndarray) -> Unpacked:
    return (_k_low_nibbles(b[..., 16:144]).astype(np.int8), *_k_scales(b))


def _q5_k(b: np.ndarray) -> Unpacked:
    qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    high = (qh & 1).reshape(*b.shape[:-1], 256)  # bit i of byte j: element 32 i + j
    return ((_k_low_nibbles(b[..., 48:176]) | (high << 4)).astype(np.int8), *_k_scales(b))


def _q6_k(b: np.ndarray) -> Unpacked:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = ((ql & 0x0F).reshape(*lead, 256)) | ((qh & 0x03).reshape(*lead, 256) << 4)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(b, 208)[..., None] * sc  # [N, nb, 16]
    return q.astype(np.int8) - 32, scale.reshape(b.shape[0], -1), None


@dataclass(frozen=True)
class _BlockFormat:
    block_len: int  # weights per ggml block
    block_bytes: int
    group_len: int
    nibble_offset: int | None  # None: int8 codes; else nibble codes with this offset
    unpack: Callable[[np.ndarray], Unpacked]


_FORMATS: dict[str, _BlockFormat] = {
    "Q4_0": _BlockFormat(32, 18, 32, 8, _q4_0),
    "Q4_1": _BlockFormat(32, 20, 32, 0, _q4_1),
    "Q5_0": _BlockFormat(32, 22, 32, None, _q5_0),
    "Q5_1": _BlockFormat(32, 24, 32, None, _q5_1),
    "Q8_0": _BlockFormat(32, 34, 32, None, _q8_0),
    "Q4_K": _BlockFormat(256, 144, 32, 0, _q4_k),
    "Q5_K": _BlockFormat(256, 176, 32, None, _q5_k),
    "Q6_K": _BlockFormat(256, 210, 16, None, _q6_k),
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(_FORMATS)
FLOAT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")


def _type_name(ggml_type: object) -> str:
    return getattr(ggml_type, "name", None) or str(ggml_type)


def block_len(ggml_type: object) -> int:
    """Weights per ggml block: a row's length must be a multiple of it."""
    name = _type_name(ggml_type)
    if name not in _FORMATS:
        raise UnsupportedQuantizationError(name)
    return _FORMATS[name].block_len


def _pack_nibbles(c: np.ndarray, offset: int) -> np.ndarray:
    """[N, K] c in [-offset, 15 - offset] -> [N, K / 2] uint8, byte j of a group = c_j | c_{j+16} << 4."""
    u = (c.astype(np.int16) + offset).astype(np.uint8).reshape(c.shape[0], -1, 2, 16)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(c.shape[0], -1)


def repack(raw: np.ndarray, ggml_type: object, shape_rows_cols: tuple[int, int]) -> BlockWeight:
    """A GGUF tensor's raw blocks (uint8, any shape holding N * K / block_len blocks in row order)
    as a BlockWeight [N, K]; `shape_rows_cols` is the torch shape (ggml's shape reversed)."""
    name = _type_name(ggml_type)
    if name not in _FORMATS:
        raise UnsupportedQuantizationError(name)
    fmt = _FORMATS[name]
    num_rows, num_cols = shape_rows_cols
    if num_cols % fmt.block_len:
        raise ValueError(f"{name} rows need a multiple of {fmt.block_len} columns, not {num_cols}")
    blocks_per_row = num_cols // fmt.block_len
    expected_bytes = num_rows * blocks_per_row * fmt.block_bytes
    data = np.asarray(raw).view(np.uint8).reshape(-1)
    if data.size != expected_bytes:
        raise ValueError(
            f"{name} [{num_rows}, {num_cols}] needs {expected_bytes} bytes, not {data.size}"
        )
    c, scale, bias = fmt.unpack(data.reshape(num_rows, blocks_per_row, fmt.block_bytes))
    c = c.reshape(num_rows, num_cols)
    if fmt.nibble_offset is None:
        codes = torch.from_numpy(np.ascontiguousarray(c, dtype=np.int8))
    else:
        codes = torch.from_numpy(_pack_nibbles(c, fmt.nibble_offset))
    return BlockWeight(
        ggml_type=name,
        num_cols=num_cols,
        codes=codes,
        scales=torch.from_numpy(np.ascontiguousarray(scale.reshape(num_rows, -1), np.float32)),
        biases=None
        if bias is None
        else torch.from_numpy(np.ascontiguousarray(bias.reshape(num_rows, -1), np.float32)),
        group_len=fmt.group_len,
        code_offset=fmt.nibble_offset or 0,
    )


def float_tensor(raw: np.ndarray, ggml_type: object, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32/F16/BF16 GGUF tensor (raw values or bytes) as a torch fp32 tensor of `shape` (torch
    order). The conversions are exact."""
    name = _type_name(ggml_type)
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if name == "F32":
        values = torch.from_numpy(data.view(np.float32).copy())
    elif name == "F16":
        values = torch.from_numpy(data.view(np.float16).astype(np.float32))
    elif name == "BF16":
        values = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
    else:
        raise UnsupportedQuantizationError(name)
    return values.reshape(shape)


# --- the panel kernel's integer formats: the file's codes as they are, activations rounded to int8 ------


# ggml types whose blocks are one of kvserve's integer formats over groups of 32 (docs/gguf.md, "int8
# activations"): codes and fp16 scales carried over unchanged; Q4_1's min m enters as the zero-point
# z = -m / d rounded to fp16, the one value that is not the file's bit for bit.
def as_quantized_tensor(parts: list[BlockWeight], act: str | None = None):
    """The stacked rows of `parts` as a `QuantizedTensor` the panel kernel runs (kvserve/quant/rtn.py),
    or None when a part's type has no such format or its values do not fit it (a zero scale with a
    nonzero min, a zero-point outside fp16). `act`: how its activations are rounded (TensorScheme.act;
    None: the format's own, per 32 inputs)."""
    from kvserve.quant.rtn import QuantizedTensor
    from kvserve.quant.scheme import parse_weight_scheme

    names = {PANEL_FORMATS.get(p.ggml_type) for p in parts}
    if len(names) != 1 or None in names:
        return None
    scheme = parse_weight_scheme(names.pop()).linear
    if act is not None:
        scheme = replace(scheme, act=act)
    codes = torch.cat([p.code_values() for p in parts])
    scales = torch.cat([p.scales for p in parts])
    half_scales = scales.to(torch.float16)
    if not torch.equal(half_scales.float(), scales):  # ggml's d is fp16: always exact
        return None
    zeros = None
    if scheme.zero_point:
        biases = torch.cat([p.biases for p in parts])
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        zeros = (-biases / safe).to(torch.float16)
        if not torch.isfinite(zeros).all() or bool(((scales == 0) & (biases != 0)).any()):
            return None
    return QuantizedTensor(scheme, codes, half_scales, zeros)
