"""The integer GEMM extension (csrc/qgemm.cpp): built once per machine, then loaded from a cache.

The C++ source is compiled with torch's own headers on first use (gcc and ninja, ~1 min on 2 cores)
into cache_dir("ext")/<torch version>-<source hash> (kvserve/paths.py); later
processes load the built library. It picks its AVX2 path or a scalar one by the CPU's capabilities at
run time. When it cannot be built (no compiler), `kernels_available()` is False and quantised linears
fall back to a dequantised fp32 weight, which is logged and reported as such.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
from pathlib import Path

import torch

from kvserve.paths import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "qgemm.cpp"
ISA_NAMES = {2: "avx2", 0: "scalar"}


def extension_dir() -> Path:
    """Where the built extension is cached (kvserve/paths.py), per torch version and source."""
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir("ext") / f"torch{torch.__version__}-{digest}"


@functools.cache
def _load() -> str | None:
    """Build (or load the cached build of) the extension; None on success, else why it failed."""
    if not hasattr(torch.ops, "kvq") or not hasattr(torch.ops.kvq, "q8_linear"):
        try:
            from torch.utils import cpp_extension

            build_dir = extension_dir()
            build_dir.mkdir(parents=True, exist_ok=True)
            # torch's own build lock is a file that a killed build leaves behind, and every later
            # process would wait on it forever. An flock is released when its holder dies: whoever
            # holds it is the only builder, so a torch lock found then is stale.
            with open(build_dir / "kvserve.flock", "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                (build_dir / "lock").unlink(missing_ok=True)
                cpp_extension.load(
                    name="kvserve_qgemm",
                    sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=False,
                )
        except Exception as exc:  # a missing compiler or ninja: the caller falls back, loudly
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    return None


@functools.cache
def kernels_available() -> bool:
    reason = _load()
    if reason is not None:
        logger.warning("quantised kernels unavailable (%s); using dequantised fp32 weights", reason)
    return reason is None


def kernel_isa() -> str:
    """The instruction set the kernels run on this CPU: "avx2", "scalar", or "unavailable"."""
    if not kernels_available():
        return "unavailable"
    return ISA_NAMES.get(int(torch.ops.kvq.isa()), "scalar")


def set_extension_max_isa(name: str) -> None:
    """Cap this extension's instruction set ("avx512", "avx2" or "scalar"; it has no AVX-512 path,
    so "avx512" leaves it on AVX2). kvserve.model.kernel_choice.set_max_isa caps every kernel."""
    kernels_available()
    level = {v: k for k, v in ISA_NAMES.items()}[name if name != "avx512" else "avx2"]
    torch.ops.kvq.set_max_isa(level)
