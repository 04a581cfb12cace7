"""Which native kernels run here: the C library's panel GEMVs (model/csrc, model/fused_decode.py)
where it builds, else the quantised GEMM extension (quant/csrc/qgemm.cpp, quant/kernels.py).
The engine core reports the choice (`EngineInfo.kernel_isa`, `bf16_products`) and /manifest shows
it; the API process never loads either library (docs/design.md)."""

from __future__ import annotations

import ctypes
import functools
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.model import fused_decode
from kvserve.quant.kernels import kernel_isa, set_extension_max_isa
from kvserve.quant.scheme import WeightScheme

# The row counts the per-shape kernel table (model/kernel_table.py) is measured at: 1, 2, 4, ... 512;
# a linear's `row_kernels` holds one choice per bucket.
ROW_BUCKETS = tuple(1 << i for i in range(10))


def bucket_index(num_rows: int) -> int:
    """Index into ROW_BUCKETS of the smallest bucket holding `num_rows` (the last for more)."""
    return min(max(num_rows - 1, 0).bit_length(), len(ROW_BUCKETS) - 1)


def served_kernel_isa() -> str:
    """The instruction set quantised linears run on: the native panel GEMV's (model/csrc/qgemv.c)
    where the C library builds, else the extension's ("unavailable": a dequantised stand-in)."""
    return fused_decode.isa() if fused_decode.max_rows() else kernel_isa()


def bf16_products_kernel() -> str:
    """What runs `bf16` linears here (csrc/bf16dot.c): "vdpbf16ps" (AVX512_BF16), "avx512-fma"
    (the same operations on fp32 FMAs), "portable" (scalar loops, slower than fp32) or "torch" (no
    C kernels)."""
    if not fused_decode.max_rows():
        return "torch"
    if fused_decode.bf16_insn():
        return "vdpbf16ps"
    return "avx512-fma" if fused_decode.isa() == "avx512" else "portable"


def set_max_isa(name: str) -> None:
    """Cap every kernel's instruction set ("avx512", "avx2" or "scalar"): tests run the fallbacks
    this way. The panel GEMVs quantised linears take (model/fused_decode.py) follow the cap."""
    set_extension_max_isa(name)
    if fused_decode.max_rows():
        fused_decode.set_max_isa(name)


def served_kernels(
    model_dir: str | Path, scheme: WeightScheme | None, kernel_table: dict | None = None
) -> dict:
    """`EngineInfo.kernel_isa` and `bf16_products` for /manifest: the kernels the served weights
    run on, "" for what they do not use (quantised weights: at load, or a checkpoint's
    quantization_config; bf16 products: a load-time scheme with them), so that an unquantised model
    never builds the quantised GEMM extension to say so. `matrix_engine`: the probe's verdict
    ("amx-bf16", "none: cpu flag absent", ...); `kernel_table`: the model's per-shape choice
    (model/kernel_table.py, {"out x in/format": {"rows bucket": kernel}}; {} for the fixed rules)."""
    config_path = Path(model_dir) / "config.json"
    checkpoint_quantized = config_path.is_file() and (
        json.loads(config_path.read_text()).get("quantization_config") is not None
    )
    bf16 = scheme is not None and scheme.runs_bf16
    return {
        "kernel_isa": served_kernel_isa() if scheme is not None or checkpoint_quantized else "",
        "bf16_products": bf16_products_kernel() if bf16 else "",
        "matrix_engine": probe_matrix_engine().label,
        "kernel_table": dict(kernel_table or {}),
    }


# The matrix engine: AMX tiles, usable only when the CPU has them, the OS grants the tile state and
# torch agrees (a cpuid flag alone is not enough: ggml's AMX kernels die with SIGILL where the OS has
# not granted XTILEDATA). kvserve has no AMX code of its own: where the probe says "amx-bf16", the
# bf16 GEMM candidate is torch's (oneDNN), which runs on AMX there (model/kernel_table.py).
SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
AMX_FLAGS = ("amx_tile", "amx_bf16")


@dataclass(frozen=True)
class MatrixEngine:
    """What the probe found: `name` "amx-bf16" or "none", `reason` why not ("" when usable), and
    the vector extensions the flags report."""

    name: str
    reason: str
    amx_int8: bool = False
    avx2: bool = False
    avx512_bf16: bool = False
    vnni: bool = False

    @property
    def usable(self) -> bool:
        return self.name != "none"

    @property
    def label(self) -> str:
        """/manifest's `matrix_engine`: "amx-bf16" or "none: <reason>"."""
        return self.name if self.usable else f"none: {self.reason}"

    def summary(self) -> str:
        """The load log's line: "amx: no (cpu flag absent); avx2 yes, avx512_bf16 no, vnni no"."""
        amx = "yes" + (" (int8 too)" if self.amx_int8 else "") if self.usable else "no"
        amx += "" if self.usable else f" ({self.reason})"
        yes = {True: "yes", False: "no"}
        return (
            f"amx: {amx}; avx2 {yes[self.avx2]}, avx512_bf16 {yes[self.avx512_bf16]}, "
            f"vnni {yes[self.vnni]}"
        )


def decide_matrix_engine(
    flags: frozenset[str] | set[str],
    request_rc: int | None,
    perm_bits: int | None,
    torch_amx: bool | None,
) -> MatrixEngine:
    """The decision, from plain facts: the CPU's flags (/proc/cpuinfo), what
    `arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)` returned (None: not asked), the permission bits
    `ARCH_GET_XCOMP_PERM` then reported (None: not read), and
    `torch.cpu._is_amx_tile_supported()` (None: this torch has no such query)."""
    extras = {
        "amx_int8": "amx_int8" in flags,
        "avx2": "avx2" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "vnni": "avx512_vnni" in flags or "avx_vnni" in flags,
    }
    if not all(f in flags for f in AMX_FLAGS):
        return MatrixEngine("none", "cpu flag absent", **extras)
    if request_rc != 0 or perm_bits is None or not perm_bits >> XFEATURE_XTILEDATA & 1:
        return MatrixEngine("none", "os refused", **extras)
    if torch_amx is False:
        return MatrixEngine("none", "torch reports no amx", **extras)
    return MatrixEngine("amx-bf16", "", **extras)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags ("" when the file is missing: no extension assumed)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _request_tile_state() -> tuple[int | None, int | None]:
    """(rc of ARCH_REQ_XCOMP_PERM, bits from ARCH_GET_XCOMP_PERM); (None, None) off x86-64 Linux."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
        syscall.restype = ctypes.c_long
        rc = int(syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))
        bits = ctypes.c_uint64(0)
        got = int(syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(bits)))
    except (OSError, AttributeError):
        return None, None
    return rc, (int(bits.value) if got == 0 else None)


@functools.cache
def probe_matrix_engine() -> MatrixEngine:
    """This process's matrix engine, probed once: the flags, then (only where they name AMX) the
    OS's grant of the tile state, then torch's own check."""
    flags = cpu_flags()
    rc, bits = (None, None)
    if all(f in flags for f in AMX_FLAGS):
        rc, bits = _request_tile_state()
    query = getattr(torch.cpu, "_is_amx_tile_supported", None)
    torch_amx = bool(query()) if query is not None else None
    return decide_matrix_engine(flags, rc, bits, torch_amx)


def torch_bf16_gemm() -> bool:
    """Whether torch's bf16 GEMM runs on hardware bf16 here (oneDNN: AMX or AVX512_BF16); where it
    does not, bf16 through torch is an emulation slower than fp32 and is not a candidate."""
    engine = probe_matrix_engine()
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (engine.usable or engine.avx512_bf16) and bool(supported is not None and supported())
