"""The tensors of a GGUF file without its metadata values, for tests: gguf.GGUFReader builds a numpy view
of every metadata item (Gemma 3's 262k-token vocabulary takes it ~20-50 s here); this walks past them
with struct and memmaps the tensor data (GGUF v2/v3 layout, little-endian)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorRecord:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    ggml_shape: tuple[int, ...]  # ggml order: the row length first
    data: np.ndarray  # [rows, bytes per row] uint8 (memmapped)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ggml_shape))


def _skip_value(buf: memoryview, pos: int, value_type: int) -> int:
    if value_type == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALAR_BYTES:
            return pos + count * _SCALAR_BYTES[item_type]
        for _ in range(count):
            pos = _skip_value(buf, pos, item_type)
        return pos
    return pos + _SCALAR_BYTES[value_type]


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    length = struct.unpack_from("<Q", buf, pos)[0]
    return bytes(buf[pos + 8 : pos + 8 + length]).decode(), pos + 8 + length


def read_tensors(path: Path) -> list[TensorRecord]:
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    magic, _, num_tensors, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos, alignment = 24, 32
    for _ in range(num_kv):
        key, pos = _string(buf, pos)
        value_type = struct.unpack_from("<I", buf, pos)[0]
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, pos + 4)[0]
        pos = _skip_value(buf, pos + 4, value_type)
    infos = []
    for _ in range(num_tensors):
        name, pos = _string(buf, pos)
        num_dims = struct.unpack_from("<I", buf, pos)[0]
        dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        infos.append((name, gguf.GGMLQuantizationType(ggml_type), dims, offset))
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, ggml_type, dims, offset in infos:
        block_len, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        row_bytes = dims[0] // block_len * block_bytes
        num_rows = int(np.prod(dims[1:], dtype=np.int64))
        start = data_start + offset
        data = mm[start : start + num_rows * row_bytes].reshape(num_rows, row_bytes)
        tensors.append(TensorRecord(name, ggml_type, tuple(int(d) for d in dims), data))
    return tensors
