"""Measure this machine's roofline with torch, as a user would: `kvserve plan --measure`.

- bandwidth: a GEMV over a weight matrix much larger than the last-level cache (bytes read / median
  time);
- peak: the largest FLOP/s of a square GEMM (`F.linear`, as a model's layers run it) over a range of
  batch columns (1 ... many), which also traces the roof from the memory-bound side to the
  compute-bound side.

Each point: warm-up calls, then timed samples until a minimum time and a minimum count, the median
kept. A sample times enough back-to-back calls to last about a millisecond, synchronising an
accelerator before and after. The result is a `HardwareProfile` (measured=True) the planner reads as
`this-machine`.

On a CPU the default dtype is fp32: bf16 speed on CPUs depends on the instruction set (AVX512-BF16,
AMX) and torch's kernels, and can be far from fp32's (measure it with --dtype bf16 when it matters).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.lab.plan.hardware import HardwareProfile, MeasuredPoint

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MeasureConfig:
    device: str = "cpu"
    dtype: str = "fp32"
    gemv_rows: int = 8192
    gemv_cols: int = 4096  # 8192 x 4096 fp32 = 134 MB, well above a desktop's last-level cache
    gemm_size: int = 4096
    columns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    warmup: int = 2
    min_samples: int = 5
    min_time_s: float = 0.5  # per point
    sample_s: float = 1e-3  # calls are grouped so one sample lasts at least this long
    budget_s: float = 45.0  # larger column counts are skipped once this is spent
    # engine decode attention (kvserve.lab.measure_engine): timed at each of these contexts (at least
    # two), over caches of about this size at the longest
    attention_contexts: tuple[int, ...] = (128, 512, 2048)
    attention_cache_bytes: float = 256e6
    # each attention point is the median of this many rounds, its contexts in A B C, C B A order:
    # one timing of 4 rows x 2000 tokens moved 1.8-3.5 ms per layer between runs (docs/planning.md)
    attention_rounds: int = 3
    # the host-cost points (kvserve.lab.measure_engine.measure_dispatch): the median of this many
    # rounds of the 1-layer and many-layer decoders, alternating which goes first
    dispatch_rounds: int = 3

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}")
        if len(set(self.attention_contexts)) < 2 or min(self.attention_contexts) < 1:
            raise ValueError("attention_contexts: at least two distinct positive contexts")
        if self.attention_rounds < 1 or self.dispatch_rounds < 1:
            raise ValueError("attention_rounds and dispatch_rounds must be at least 1")


def default_config(device: str = "cpu", dtype: str | None = None) -> MeasureConfig:
    """Sizes that fit in about a minute: a CPU in fp32; an accelerator in bf16, bigger matrices."""
    if device == "cpu":
        return MeasureConfig(device="cpu", dtype=dtype or "fp32")
    return MeasureConfig(
        device=device,
        dtype=dtype or "bf16",
        gemv_rows=16384,
        gemv_cols=16384,
        gemm_size=8192,
        columns=tuple(2**i for i in range(15)),
        budget_s=40.0,
    )


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def time_median_s(fn: Callable[[], object], cfg: MeasureConfig) -> float:
    """Median seconds per call of `fn` after warm-up."""
    sync = _sync(cfg.device)
    for _ in range(cfg.warmup):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    first_s = time.perf_counter() - start
    calls = max(1, min(1000, math.ceil(cfg.sample_s / max(first_s, 1e-9))))
    samples: list[float] = []
    spent = 0.0
    while len(samples) < cfg.min_samples or spent < cfg.min_time_s:
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        samples.append(elapsed / calls)
        spent += elapsed
    return statistics.median(samples)


def memory_bytes(device: str) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# A probe of streaming kernels cycles through copies of its matrices until they add up to what a
# decode step reads (the model's weights per step), up to several times the last-level cache: a
# set just over the cache still partly hits in it (Zen 3, 32 MiB L3: an int8 head of 28 MB called
# over and over ran 1.7x faster than cycling 6 copies; 3 copies, 8-12% faster than 6).
STREAM_SPAN_LLC = 8
STREAM_SPAN_MAX_BYTES = float(1 << 30)
DEFAULT_LLC_BYTES = 32 << 20  # where the system does not say


def last_level_cache_bytes(
    device: str = "cpu", cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")
) -> int:
    """The largest cache of `device`: on a CPU the largest of cpu0's caches in sysfs
    (`cache_dir`/index*/size), on CUDA the L2; DEFAULT_LLC_BYTES where neither says."""
    if device.startswith("cuda"):
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or (
            DEFAULT_LLC_BYTES
        )
    best = 0
    for index in cache_dir.glob("index*"):
        try:
            size = (index / "size").read_text().strip()  # "32768K"
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KkMmGg")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best or DEFAULT_LLC_BYTES


def stream_copies(set_bytes: float, step_bytes: float | None = None, device: str = "cpu") -> int:
    """How many copies of a probe's matrices (`set_bytes` in all) its calls cycle through so that
    they stream from memory as a decode step's do: up to STREAM_SPAN_LLC x the last-level cache
    (at most STREAM_SPAN_MAX_BYTES), or `step_bytes` (the weights a model's step reads) where
    that is less; at least one."""
    span = min(STREAM_SPAN_LLC * last_level_cache_bytes(device), STREAM_SPAN_MAX_BYTES)
    if step_bytes is not None:
        span = min(span, step_bytes)
    return max(1, math.ceil(span / max(set_bytes, 1.0)))


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_gemv(cfg: MeasureConfig) -> MeasuredPoint:
    dtype, b = _DTYPES[cfg.dtype], _DTYPES[cfg.dtype].itemsize
    weight = torch.randn(cfg.gemv_rows, cfg.gemv_cols, device=cfg.device, dtype=dtype)
    x = torch.randn(cfg.gemv_cols, device=cfg.device, dtype=dtype)
    median_s = time_median_s(lambda: torch.mv(weight, x), cfg)
    flops = 2 * cfg.gemv_rows * cfg.gemv_cols
    num_bytes = b * (cfg.gemv_rows * cfg.gemv_cols + cfg.gemv_rows + cfg.gemv_cols)
    return MeasuredPoint(
        "gemv", 1, flops / median_s, num_bytes / median_s, flops / num_bytes, median_s
    )


def measure_gemm(cfg: MeasureConfig, deadline: float) -> list[MeasuredPoint]:
    dtype, b, k = _DTYPES[cfg.dtype], _DTYPES[cfg.dtype].itemsize, cfg.gemm_size
    weight = torch.randn(k, k, device=cfg.device, dtype=dtype)  # [out, in]
    points = []
    for n in cfg.columns:
        if time.perf_counter() > deadline:
            break
        # As a model's linear layers run it: x [batch, in] times weight [out, in] transposed.
        x = torch.randn(n, k, device=cfg.device, dtype=dtype)  # [batch columns, in]
        median_s = time_median_s(lambda x=x: torch.nn.functional.linear(x, weight), cfg)
        flops = 2 * k * k * n
        num_bytes = b * (k * k + 2 * k * n)
        points.append(
            MeasuredPoint(
                "gemm", n, flops / median_s, num_bytes / median_s, flops / num_bytes, median_s
            )
        )
    return points


def measure_roofline(
    cfg: MeasureConfig | None = None,
    name: str = "this-machine",
    progress: Callable[[MeasuredPoint], None] | None = None,
) -> HardwareProfile:
    """Time the GEMV and GEMM points and return them as a measured hardware profile."""
    cfg = cfg or default_config()
    load_1min = os.getloadavg()[0]  # other processes on the cores skew a CPU measurement
    start = time.perf_counter()
    with torch.inference_mode():
        gemv = measure_gemv(cfg)
        if progress:
            progress(gemv)
        gemm = measure_gemm(cfg, deadline=start + cfg.budget_s)
    if progress:
        for p in gemm:
            progress(p)
    skipped = [n for n in cfg.columns if n not in {p.num_columns for p in gemm}]
    best = max(gemm, key=lambda p: p.flops_per_s)
    threads = f", {torch.get_num_threads()} threads" if cfg.device == "cpu" else ""
    source = (
        f"measured by `kvserve plan --measure` on {time.strftime('%Y-%m-%d')}: "
        f"{device_name(cfg.device)}"
        f" ({cfg.device}{threads}), torch {torch.__version__}, {cfg.dtype}; bandwidth = GEMV "
        f"{cfg.gemv_rows}x{cfg.gemv_cols}; peak = best GEMM {cfg.gemm_size}x{cfg.gemm_size} over "
        f"{best.num_columns} columns; medians after {cfg.warmup} warm-up calls, in "
        f"{time.perf_counter() - start:.0f} s; load average {load_1min:.2f} before starting"
        + (f"; columns {skipped} skipped (time budget)" if skipped else "")
    )
    return HardwareProfile(
        name=name,
        memory_bytes=memory_bytes(cfg.device),
        bandwidth_bytes_per_s=gemv.bytes_per_s,
        peak_flops_per_s=best.flops_per_s,
        compute_dtype=cfg.dtype,
        measured=True,
        source=source,
        points=(gemv, *gemm),
    )
