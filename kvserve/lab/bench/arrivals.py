"""Arrival processes (docs/load-tests.md).

Open loop: send times are fixed in advance, independent of completions: gamma gaps with shape k
(`--burstiness`; k = 1 is Poisson, CV of gaps = 1/sqrt(k)), `inf` (everything at t = 0), or a trace.
Closed loop: N users, each sends its next request when its previous answer ends; it has no schedule.

Gaps are drawn at unit rate and scaled by 1/rate, so a sweep's runs share the same arrival pattern
(common random numbers) and differ only in its speed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.lab.bench.records import BenchError

ARRIVAL_KINDS = ("gamma", "inf", "closed", "trace")
_GAPS = 5  # random stream id (see workloads._rng)
_BLOCK = 4096


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests arrive. `max_concurrency` is the number of users (closed) or a client-side cap
    (open loop; requests past the cap wait, and that wait shows as schedule lag)."""

    kind: str
    rate: float | None = None  # requests/s, gamma only
    burstiness: float = 1.0
    max_concurrency: int | None = None
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise BenchError(f"arrival process must be one of {ARRIVAL_KINDS}, got {self.kind!r}")
        if self.kind == "gamma" and not (self.rate and 0 < self.rate < math.inf):
            raise BenchError(f"--request-rate must be a positive number or inf, got {self.rate}")
        if not self.burstiness > 0 or math.isinf(self.burstiness):  # NaN fails `> 0`
            raise BenchError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if self.kind == "closed" and not self.max_concurrency:
            raise BenchError("a closed loop needs --max-concurrency N users")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError("--max-concurrency must be >= 1")
        if self.kind == "trace" and not self.trace_path:
            raise BenchError("a trace arrival process needs --trace PATH")

    @property
    def is_open_loop(self) -> bool:
        return self.kind != "closed"

    @property
    def nominal_rate(self) -> float | None:
        return {"gamma": self.rate, "inf": math.inf}.get(self.kind)

    def with_rate(self, rate: float) -> ArrivalSpec:
        kind = "inf" if math.isinf(rate) else "gamma"
        return ArrivalSpec(
            kind, None if kind == "inf" else rate, self.burstiness, self.max_concurrency
        )

    def describe(self) -> dict:
        out: dict = {"kind": self.kind, "loop": "open" if self.is_open_loop else "closed"}
        if self.kind == "gamma":
            name = "poisson" if self.burstiness == 1.0 else f"gamma(shape={self.burstiness:g})"
            out |= {"process": name, "rate": self.rate, "burstiness": self.burstiness}
        elif self.kind == "inf":
            out |= {"process": "all at t=0", "rate": "inf"}
        elif self.kind == "trace":
            out |= {"process": "trace", "trace": self.trace_path}
        else:
            out |= {"process": f"closed loop, {self.max_concurrency} users"}
        if self.max_concurrency is not None and self.is_open_loop:
            out["client_concurrency_cap"] = self.max_concurrency
        return out


@dataclass(frozen=True)
class Trace:
    """Arrival offsets (seconds from the first arrival) and optional per-request (input, output)
    lengths."""

    offsets_s: tuple[float, ...]
    lengths: tuple[tuple[int | None, int | None], ...] | None = None


def load_trace(path: str | Path) -> Trace:
    """One arrival per line: a number (seconds), or a JSON object with `timestamp` (or `t`) in
    seconds and optional `input_len` / `output_len`. Offsets are shifted to start at 0 and must not
    decrease."""
    times: list[float] = []
    lengths: list[tuple[int | None, int | None]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BenchError(f"cannot read trace {path}: {exc}") from exc
    for num, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, dict):
                t = float(obj.get("timestamp", obj.get("t")))
                lengths.append((obj.get("input_len"), obj.get("output_len")))
            else:
                t = float(obj)
                lengths.append((None, None))
        except (ValueError, TypeError) as exc:
            raise BenchError(f"{path}:{num}: not a time or a JSON object with 'timestamp'") from exc
        if times and t < times[-1]:
            raise BenchError(f"{path}:{num}: arrival times must not decrease")
        times.append(t)
    if not times:
        raise BenchError(f"trace {path} has no arrivals")
    offsets = tuple(t - times[0] for t in times)
    has_lengths = any(a is not None or b is not None for a, b in lengths)
    return Trace(offsets, tuple(lengths) if has_lengths else None)


def unit_gaps(num_gaps: int, burstiness: float, seed: int) -> np.ndarray:
    """Gamma(shape=k, scale=1/k) gaps (mean 1, CV 1/sqrt(k)). The first n gaps do not depend on how
    many are drawn: they come in fixed blocks from one stream."""
    rng = np.random.default_rng([seed, _GAPS])
    blocks = [
        rng.gamma(burstiness, 1.0 / burstiness, size=_BLOCK) for _ in range(num_gaps // _BLOCK + 1)
    ]
    return np.concatenate(blocks)[:num_gaps]


def gamma_offsets(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send offsets in seconds: the first at 0, then num - 1 gamma gaps at the given rate."""
    if num <= 0:
        return np.zeros(0)
    return np.concatenate([[0.0], np.cumsum(unit_gaps(num - 1, burstiness, seed) / rate)])


def schedule(
    spec: ArrivalSpec,
    seed: int,
    num_warmup: int,
    num_requests: int | None,
    duration_s: float | None,
) -> tuple[float, ...] | None:
    """Send offsets for warm-up then measured requests (None for a closed loop). The measured part
    ends after `num_requests`, or at `duration_s` after the first measured send, whichever comes
    first."""
    if spec.kind == "closed":
        return None
    if num_requests is None and duration_s is None:
        raise BenchError("give --num-requests or --duration")
    if spec.kind == "inf":
        if num_requests is None:
            raise BenchError("--request-rate inf sends everything at once: give --num-requests")
        return (0.0,) * (num_warmup + num_requests)
    if spec.kind == "trace":
        offsets = np.asarray(load_trace(spec.trace_path).offsets_s)
    elif num_requests is not None:
        offsets = gamma_offsets(num_warmup + num_requests, spec.rate, spec.burstiness, seed)
    else:
        num = num_warmup + max(16, math.ceil(duration_s * spec.rate * 1.5) + 16)
        offsets = gamma_offsets(num, spec.rate, spec.burstiness, seed)
        while offsets[-1] - offsets[min(num_warmup, num - 1)] < duration_s:
            num *= 2
            offsets = gamma_offsets(num, spec.rate, spec.burstiness, seed)
    if len(offsets) <= num_warmup:
        raise BenchError(
            f"only {len(offsets)} arrivals, not more than the {num_warmup} warm-up ones"
        )
    measured = offsets[num_warmup:]
    if duration_s is not None:
        measured = measured[measured - measured[0] < duration_s]
    if num_requests is not None:
        measured = measured[:num_requests]
    return tuple(float(t) for t in np.concatenate([offsets[:num_warmup], measured]))


def gap_stats(times_s: list[float] | np.ndarray) -> dict:
    """Realised rate ((n - 1) / span) and the coefficient of variation of the gaps between sorted
    times."""
    t = np.sort(np.asarray(times_s, dtype=float))
    if len(t) < 2 or t[-1] == t[0]:
        return {"count": int(len(t)), "rate": math.inf if len(t) > 1 else None, "gap_cv": None}
    gaps = np.diff(t)
    mean = float(gaps.mean())
    cv = float(gaps.std(ddof=1) / mean) if len(gaps) > 1 and mean > 0 else None
    return {"count": int(len(t)), "rate": (len(t) - 1) / float(t[-1] - t[0]), "gap_cv": cv}
