"""The CPU decode-attention kernel (csrc/paged_attention.c): reads the paged cache in place.

The C source is compiled once per machine with the system compiler (`-O3 -march=native -fopenmp`, about a
second) into ~/.cache/kvserve/kernels and loaded with ctypes; it shares torch's OpenMP runtime (libgomp is
loaded once, by soname) and runs on torch's thread count. Without a compiler the torch backend stands in
(logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_PTR, _INT = ctypes.c_void_p, ctypes.c_int


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "kvserve" / "kernels"


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here (reason logged)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning(
            "no C compiler found: CPU decode attention uses the torch backend (gathers KV)"
        )
        return None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    path = _cache_dir() / f"paged_attention-{digest}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run(
                [compiler, *_FLAGS, "-o", str(built), str(_SOURCE), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                logger.warning(
                    "building the CPU attention kernel failed; using the torch backend:\n%s",
                    result.stderr[-2000:],
                )
                return None
            os.replace(built, path)  # atomic: concurrent builders agree on one file
    library = ctypes.CDLL(str(path))
    fn = library.paged_decode_attention
    fn.restype = _INT
    fn.argtypes = [_PTR] * 9 + [_INT] * 6 + [ctypes.c_float, _INT]
    return library


def kernel_available() -> bool:
    return load_kernel() is not None


@functools.cache
def code_table(kind: str) -> torch.Tensor:
    """[256] fp32: the value of each 8-bit code (int8: the signed integer; fp8: the e4m3 float)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    return codes.view(dtype).float()


def paged_decode(
    q: torch.Tensor,  # [B, num_heads, head_dim] fp32, contiguous
    k: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 or uint8 codes
    v: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads] fp16 (8-bit caches)
    v_scale: torch.Tensor | None,
    kind: str,  # "float" | "int8" | "fp8"
    block_table: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor,  # [B, num_heads, head_dim] fp32, written in place
) -> None:
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k.shape
    lut = None if kind == "float" else code_table(kind)
    status = load_kernel().paged_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
        None if lut is None else lut.data_ptr(),
        block_table.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
        batch, num_heads, num_kv_heads, head_dim, block_size, block_table.shape[1],
        scale, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"paged attention kernel refused the shapes (status {status}): {num_heads} heads, "
            f"{num_kv_heads} kv heads, head_dim {head_dim}"
        )
