"""Read a GGUF file's header safely: every count and length checked against the file's size.

GGUF (ggml's single-file format, docs/gguf.md) is a header of key-value metadata and tensor
descriptions followed by the tensors' data. `read_header` walks the header with every count, length,
dimension and tensor range checked against the bytes that remain, so nothing is allocated or read
from a size that the file cannot hold, and a bad file is one `ModelLoadError` line that says what is
wrong, never a numpy traceback. The tensors' types and block sizes are `gguf`'s (ggml's own Python
package), and so is the reference dequantisation (model/block_weights.py).

Why not `gguf.GGUFReader`: it trusts the header, and it builds a numpy array per metadata item, which
took 3.2 s for SmolLM2's 49,152-token vocabulary and 16-30 s for Gemma 3's 262,144 on a loaded 2-core
machine, against about 1 s here (tests/gguf/test_gguf_reader.py checks that both read the same values,
shapes, types and bytes on the real files).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from kvserve.core.errors import ModelLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # an array of arrays at most (no real file nests deeper)
DEFAULT_ALIGNMENT = 32

# value type -> struct format of a scalar (GGUFValueType); 8 string, 9 array
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's description from the header: ggml dims (fastest first), type and data range."""

    name: str
    dims: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the data section
    num_bytes: int


class _Cursor:
    """Reads little-endian values from a byte buffer, each read checked against what remains."""

    def __init__(self, data: bytes | memoryview, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: not a valid GGUF file: {what} (at byte {self.pos})")

    def take(self, num_bytes: int, what: str) -> memoryview:
        if num_bytes < 0 or num_bytes > len(self.data) - self.pos:
            raise self.fail(
                f"{what} needs {num_bytes:,} bytes but {len(self.data) - self.pos:,} remain "
                "(truncated file or corrupt length)"
            )
        view = memoryview(self.data)[self.pos : self.pos + num_bytes]
        self.pos += num_bytes
        return view

    def scalar(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("Q", f"{what}'s length")
        raw = self.take(length, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, value_type: int, what: str, depth: int = 0) -> object:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise self.fail(f"{what} has an unknown value type {value_type}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        item_type = self.scalar("I", f"{what}'s item type")
        count = self.scalar("Q", f"{what}'s length")
        if item_type in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item_type])
            raw = self.take(count * dtype.itemsize, what)
            return np.frombuffer(raw, dtype=dtype).tolist()
        if item_type not in (_STRING, _ARRAY):
            raise self.fail(f"{what} has an unknown item type {item_type}")
        # every string or array item takes at least 8 bytes: a count the file cannot hold is
        # refused before the loop runs it
        if count * 8 > len(self.data) - self.pos:
            raise self.fail(
                f"{what} claims {count:,} items; {len(self.data) - self.pos:,} bytes remain"
            )
        return [self.value(item_type, what, depth + 1) for _ in range(count)]


def read_header(path: Path, header: bytes | memoryview, file_bytes: int) -> GGUFFile:
    """Read the header in `header` (a view of the file), every count, length, dimension and tensor
    range checked against the file; a `ModelLoadError` names the first fault."""
    from gguf.constants import GGML_QUANT_SIZES

    cur = _Cursor(header, path)
    magic = bytes(cur.take(4, "the magic number"))
    if magic != MAGIC:
        raise cur.fail(f"magic {magic!r}, expected {MAGIC!r}")
    version = cur.scalar("I", "the version")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(f"version {version}; supported: {', '.join(map(str, SUPPORTED_VERSIONS))}")
    num_tensors = cur.scalar("Q", "the tensor count")
    num_kv = cur.scalar("Q", "the metadata count")
    # the smallest key-value pair is 13 bytes and the smallest tensor description 25: counts the file
    # cannot hold are refused before anything is read for them
    if num_kv * 13 + num_tensors * 25 > file_bytes:
        raise cur.fail(
            f"{num_kv:,} metadata entries and {num_tensors:,} tensors cannot fit in "
            f"{file_bytes:,} bytes"
        )
    metadata: dict[str, object] = {}
    for i in range(num_kv):
        key = cur.string(f"metadata key {i}")
        metadata[key] = cur.value(cur.scalar("I", f"{key!r}'s type"), repr(key))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
    infos = []
    for i in range(num_tensors):
        name = cur.string(f"tensor {i}'s name")
        num_dims = cur.scalar("I", f"{name!r}'s dimension count")
        if not 1 <= num_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {num_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(cur.scalar("Q", f"{name!r}'s dimensions") for _ in range(num_dims))
        type_id = cur.scalar("I", f"{name!r}'s type")
        offset = cur.scalar("Q", f"{name!r}'s offset")
        try:
            ggml_type = GGMLQuantizationType(type_id)
            block_len, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor {name!r} has an unknown ggml type {type_id}") from None
        if any(d == 0 for d in dims) or dims[0] % block_len:
            raise cur.fail(
                f"tensor {name!r} has dimensions {list(dims)}: the first must be a "
                f"positive multiple of its type's block of {block_len}"
            )
        num_elements = math.prod(dims)
        if num_elements // block_len * block_bytes > file_bytes:
            raise cur.fail(
                f"tensor {name!r} has dimensions {list(dims)}: more data than the file holds"
            )
        infos.append(
            TensorInfo(name, dims, ggml_type, offset, num_elements // block_len * block_bytes)
        )
    data_start = -(-cur.pos // alignment) * alignment
    data_bytes = file_bytes - data_start
    tensors: dict[str, TensorInfo] = {}
    for info in infos:
        if info.name in tensors:
            raise cur.fail(f"tensor {info.name!r} is described twice")
        if info.offset % alignment or info.offset + info.num_bytes > data_bytes:
            raise ModelLoadError(
                f"{path}: not a valid GGUF file: tensor {info.name!r} needs bytes "
                f"{info.offset:,}..{info.offset + info.num_bytes:,} of a {data_bytes:,}-byte data "
                "section (truncated file or corrupt offset)"
            )
        tensors[info.name] = replace(info, offset=data_start + info.offset)
    return GGUFFile(path, version, metadata, tensors, data_start)


@dataclass(frozen=True)
class GGUFFile:
    """A checked GGUF file's header: metadata as Python values, tensors by name."""

    path: Path
    version: int
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]
    data_start: int  # where the header ends and the tensors' data begins

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, name: str, default: object = None) -> object:
        """`<architecture>.<name>`, e.g. "llama.block_count"."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, memory-mapped (uint8 [rows, row_bytes]; rows = all dims but the first)."""
        info = self.tensors[name]
        rows = math.prod(info.dims[1:])
        return np.memmap(
            self.path,
            dtype=np.uint8,
            mode="r",
            offset=info.offset,
            shape=(rows, info.num_bytes // rows),
        )


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's checked header (`read_header`); tensors stay on disk until `raw` maps them."""
    import mmap

    path = Path(path)
    try:
        with path.open("rb") as f:
            file_bytes = path.stat().st_size
            if file_bytes < 24:
                raise ModelLoadError(
                    f"{path}: not a valid GGUF file: {file_bytes} bytes is too short for a header"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return read_header(path, view, file_bytes)
                finally:
                    view.release()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
