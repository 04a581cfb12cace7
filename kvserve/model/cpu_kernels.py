"""CPU kernels in C: decode attention that reads the paged cache in place (csrc/paged_attention.c), the
decoder's small fused ops (csrc/layer_ops.c: add + RMSNorm, RoPE, KV write, SiLU-and-multiply) and the
whole decode step for a few rows (csrc/decode_step.c, driven by model/fused_decode.py) with the quantised
GEMV on its panel-interleaved layout (csrc/qgemv.c, csrc/decode_step.h), and GGUF block weights times
fp32 activations (csrc/blocks.c, driven by model/block_linear.py).

The C sources are compiled once per machine with the system compiler (`-O3 -march=native -fopenmp`, about a
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

from kvserve.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
_SOURCES = ("paged_attention.c", "layer_ops.c", "decode_step.c", "qgemv.c", "bf16dot.c", "blocks.c")
_HEADERS = ("decode_step.h", "paged_attention.h", "vexp.h", "half.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_PTR, _INT = ctypes.c_void_p, ctypes.c_int


def _cpu_identity() -> bytes:
    """What `-march=native` compiles for: the CPU's feature flags. A cached build made on another CPU
    (a home directory carried to a new machine) may use instructions this one lacks, so the flags are
    part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    import platform

    return platform.processor().encode() + platform.machine().encode()


def _cache_dir() -> Path:
    return cache_dir("kernels")


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here (reason logged)."""
    return build_kernel(SOURCE_DIR)


def build_kernel(source_dir: Path) -> ctypes.CDLL | None:
    """The library built from the C files in `source_dir` (the package's csrc/, or a modified copy
    with the same file names and the same structs: benchmarks/ab_switch.py loads two builds side by
    side to compare a change in one process), cached by the sources' hash; None when it cannot be
    built here (reason logged). A library is loaded with RTLD_LOCAL, so two builds' functions do not
    interpose each other.

    Long: compiler probing, the build and its cache in one transaction (a lock, a temporary
    directory, an atomic rename)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning(
            "no C compiler found: CPU decode attention uses the torch backend (gathers KV)"
        )
        return None
    sources = tuple(source_dir / name for name in _SOURCES)
    source = b"".join(p.read_bytes() for p in sources + tuple(source_dir / h for h in _HEADERS))
    key = source + " ".join((compiler, *_FLAGS)).encode() + _cpu_identity()
    digest = hashlib.sha256(key).hexdigest()[:16]
    path = _cache_dir() / f"kvserve_cpu-{digest}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run(
                [compiler, *_FLAGS, "-o", str(built), *map(str, sources), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                logger.warning(
                    "building the CPU kernels failed; using torch ops:\n%s",
                    result.stderr[-2000:],
                )
                return None
            os.replace(built, path)  # atomic: concurrent builders agree on one file
    library = ctypes.CDLL(str(path))
    i64, f32 = ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_decode_attention": ([_PTR] * 9 + [i64] + [_INT] * 6 + [f32, _INT], _INT),
        "paged_decode_attention_window": (
            [_PTR] * 9 + [i64] + [_INT] * 6 + [f32, _INT, _INT],
            _INT,
        ),
        "add_rms_norm": ([_PTR] * 5 + [_INT, _INT, f32, _INT], None),
        "rotary": ([_PTR, i64, _PTR, _PTR, _INT, _INT, _INT, _INT], None),
        "write_kv": ([_PTR, _PTR, i64, _PTR, _PTR, _PTR, _INT, _INT, _INT], None),
        "write_kv_q": ([_PTR, _PTR, i64] + [_PTR] * 5 + [_INT] * 5, None),
        "silu_mul": ([_PTR, _PTR, _INT, _INT, _INT], None),
        # decode_step.c (model/fused_decode.py)
        "decode_isa": ([], _INT),
        "decode_cpu_isa": ([], _INT),
        "decode_set_max_isa": ([_INT], None),
        "decode_set_pooled_step": ([_INT], None),
        "decode_set_guided": ([_INT], None),
        "decode_pooled_steps": ([], ctypes.c_int64),
        "decode_max_rows": ([], _INT),
        "decode_set_f32_max_rows": ([_INT], None),
        "decode_f32_max_rows": ([], _INT),
        "decode_step_max_rows": ([_PTR], _INT),
        "small_linear": ([_PTR, _PTR, _INT, _PTR, _INT], _INT),
        # blocks.c (model/block_linear.py): x, ldx, M, K, codes, nibble, offset, scales, biases, group
        # length, N, out bias, y, ldy, threads
        "block_linear": (
            [_PTR, i64, _INT, _INT, _PTR, _INT, _INT]
            + [_PTR] * 2
            + [_INT] * 2
            + [_PTR] * 2
            + [i64, _INT],
            _INT,
        ),
        # codes, nibble, offset, scales, biases, group length, K, row ids, row0, R, out, ldo, threads
        "block_dequant_rows": (
            [_PTR, _INT, _INT, _PTR, _PTR, _INT, _INT, _PTR, i64, _INT, _PTR, i64, _INT],
            _INT,
        ),
        # bf16dot.c
        "decode_has_bf16_insn": ([], _INT),
        "decode_set_bf16_insn": ([_INT], None),
        "decode_layers": ([_PTR, _PTR, _INT, _PTR, _PTR, _PTR, _PTR, _INT, _PTR, _INT], _INT),
        # model, ids, positions, M, embed kind, table, vocab, cos, sin, max positions, hidden, slots,
        # block table, max blocks, context lengths, threads
        "decode_step_tokens": (
            [_PTR] * 3 + [_INT, _INT, _PTR, i64, _PTR, _PTR, i64] + [_PTR] * 3 + [_INT, _PTR, _INT],
            _INT,
        ),
    }
    for name, (argtypes, restype) in signatures.items():
        # None: a build of older sources without this function (ab_switch.py loads them)
        fn = getattr(library, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
    return library


def kernel_available() -> bool:
    return load_kernel() is not None


@functools.cache
def code_table(kind: str) -> torch.Tensor:
    """[256] fp32: the value of each 8-bit code (int8: the signed integer; fp8: the e4m3 float)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    return codes.view(dtype).float()


def table_args(
    block_table: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table and context lengths as the C kernels read them: int32, rows back to back
    (they step rows by the table's width; a column slice of a wider table would be misread)."""
    if block_table.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError(
            f"block table and context lengths must be int32, not {block_table.dtype} and "
            f"{context_lens.dtype}"
        )
    return block_table.contiguous(), context_lens.contiguous()


def context_error(
    context_lens: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> ValueError:
    """The kernels' status -3."""
    return ValueError(
        f"a context length in {context_lens.tolist()} is negative or exceeds the block table's "
        f"{block_table.shape[1]} blocks x {block_size} positions"
    )


def paged_decode(
    q: torch.Tensor,  # [B, num_heads, head_dim] fp32, heads contiguous (rows may be strided)
    k: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 or uint8 codes
    v: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads] fp16 (8-bit caches)
    v_scale: torch.Tensor | None,
    kind: str,  # "float" | "int8" | "fp8"
    block_table: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor,  # [B, num_heads, head_dim] fp32, written in place
    window: int = 0,  # > 0: each row reads its last `window` positions only
) -> None:
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k.shape
    block_table, context_lens = table_args(block_table, context_lens)
    lut = None if kind == "float" else code_table(kind)
    args = (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
        None if lut is None else lut.data_ptr(),
        block_table.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        q.stride(0),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_table.shape[1],
        scale,
        torch.get_num_threads(),
    )
    kernel = load_kernel()
    if window > 0:
        status = kernel.paged_decode_attention_window(*args, window)
    else:
        status = kernel.paged_decode_attention(*args)
    if status == -3:
        raise context_error(context_lens, block_table, block_size)
    if status != 0:
        raise ValueError(
            f"paged attention kernel refused the shapes (status {status}): {num_heads} heads, "
            f"{num_kv_heads} kv heads, head_dim {head_dim}"
        )


def add_rms_norm(
    x: torch.Tensor,  # [T, D] fp32 contiguous
    residual: torch.Tensor | None,  # [T, D]: added to x first (None: x is the residual stream)
    weight: torch.Tensor,  # [D]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual)."""
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    num_rows, dim = x.shape
    out = torch.empty_like(x)
    residual_out = x if residual is None else torch.empty_like(x)
    load_kernel().add_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        residual_out.data_ptr(),
        num_rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    return out, residual_out


def rotary_(
    qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) head_dim] fp32 contiguous, rotated in place
    cos: torch.Tensor,  # [T, 1, head_dim / 2] of each row's position, contiguous
    sin: torch.Tensor,
    num_rotated_heads: int,  # q heads then k heads
    head_dim: int,
) -> None:
    if qkv.stride(1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rotary_ needs rows of contiguous values and contiguous cos/sin")
    load_kernel().rotary(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        qkv.shape[0],
        num_rotated_heads,
        head_dim,
        torch.get_num_threads(),
    )


def write_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim] views of rows of one buffer (same row stride as v)
    v: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32
    v_cache: torch.Tensor,
) -> None:
    num_rows, num_kv_heads, head_dim = k.shape
    load_kernel().write_kv(
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_rows,
        num_kv_heads * head_dim,
        torch.get_num_threads(),
    )


KV_KINDS = {"float": 0, "int8": 1, "fp8": 2}  # cache kinds as the C kernels number them


def write_kv_q(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim] fp32 views of rows of one buffer (as write_kv)
    v: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    cache,  # an 8-bit LayerKVCache (kv_cache.py): uint8 codes and fp16 scales
) -> None:
    """The rows into an 8-bit cache: the codes and scales kv_cache.quantise gives, bit for bit."""
    if k.dtype != torch.float32 or k.stride(-1) != 1 or k.stride(1) != k.shape[2]:
        raise ValueError("write_kv_q needs fp32 rows of contiguous heads")
    num_rows, num_kv_heads, head_dim = k.shape
    load_kernel().write_kv_q(
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        slots.data_ptr(),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        cache.k_scale.data_ptr(),
        cache.v_scale.data_ptr(),
        num_rows,
        num_kv_heads,
        head_dim,
        KV_KINDS[cache.kind],
        torch.get_num_threads(),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] fp32 contiguous (gate first) -> silu(gate) * up [T, I]."""
    gate_up = gate_up.contiguous()
    num_rows, width = gate_up.shape
    out = gate_up.new_empty(num_rows, width // 2)
    load_kernel().silu_mul(
        gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, torch.get_num_threads()
    )
    return out
