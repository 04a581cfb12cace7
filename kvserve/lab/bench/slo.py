"""Named service-level objectives and goodput (docs/metrics.md).

Two styles, never mixed in one objective set, and always reported with their name:

- per request (`ttft=3s,worst_gap=100ms`): a request counts when it completed and met every
objective;
  goodput = such requests / measured window; attainment = such requests / all measured requests (a
  failed, rejected or timed-out request never meets an objective).
- pooled percentiles (`p99_ttft=3s,p99_itl=100ms`): the run passes when every percentile of the
pooled raw
  samples is within its limit; goodput = completed requests / window if it passes, else 0. A pooled
  pass is not a per-user guarantee (long answers dominate pooled ITL).

A metric that is undefined for a request (TPOT of a one-token answer, worst gap of a one-chunk
answer) does not violate its objective. Pooled objectives are not met when no request completed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.lab.bench.metrics import RequestMetrics, percentile
from kvserve.lab.bench.records import BenchError

PER_REQUEST_METRICS = {
    "ttft": "ttft_s",
    "tpot": "tpot_s",
    "e2e": "e2e_s",
    "worst_gap": "worst_gap_s",
    "queue_time": "queue_time_s",
}
POOLED_METRICS = ("ttft", "tpot", "itl", "itl_token", "e2e", "worst_gap", "queue_time")
_LABELS = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "itl_token": "token ITL",
    "e2e": "E2E",
    "worst_gap": "worst gap",
    "queue_time": "queue time",
}
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "": 1.0}
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|ms|s|m|)\s*$")
_POOLED_KEY_RE = re.compile(r"^p([0-9]+(?:\.[0-9]+)?)_(\w+)$")


def parse_duration_s(text: str) -> float:
    """`3s`, `100ms`, `250us`, `2m`, or a bare number of seconds."""
    match = _DURATION_RE.match(text)
    if not match:
        raise BenchError(f"bad duration {text!r}: use e.g. 3s, 100ms, 250us")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _fmt_s(value: float) -> str:
    return f"{value * 1e3:g} ms" if value < 1 else f"{value:g} s"


@dataclass(frozen=True)
class Objective:
    """metric <= limit_s, for each request (percentile None) or for a pooled percentile."""

    metric: str
    limit_s: float
    percentile: float | None = None

    def describe(self) -> str:
        label = _LABELS[self.metric]
        if self.percentile is None:
            return f"{label} <= {_fmt_s(self.limit_s)}"
        return f"pooled p{self.percentile:g} {label} <= {_fmt_s(self.limit_s)}"


@dataclass(frozen=True)
class ObjectiveSet:
    objectives: tuple[Objective, ...]

    def __post_init__(self) -> None:
        if not self.objectives:
            raise BenchError("an objective set needs at least one objective")
        if len({o.percentile is None for o in self.objectives}) != 1:
            raise BenchError("do not mix per-request and pooled-percentile objectives in one --slo")

    @property
    def style(self) -> str:
        return "per-request" if self.objectives[0].percentile is None else "pooled"

    @property
    def name(self) -> str:
        text = " and ".join(o.describe() for o in self.objectives)
        return text + " per request" if self.style == "per-request" else text

    @classmethod
    def parse(cls, text: str) -> ObjectiveSet:
        objectives = []
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise BenchError(f"bad objective {item!r}: use metric=limit, e.g. ttft=3s")
            key = key.strip()
            pooled = _POOLED_KEY_RE.match(key)
            if pooled:
                q, metric = float(pooled.group(1)), pooled.group(2)
                if metric not in POOLED_METRICS or not 0 < q <= 100:
                    raise BenchError(f"bad pooled objective {key!r}: metrics are {POOLED_METRICS}")
                objectives.append(Objective(metric, parse_duration_s(value), q))
            elif key in PER_REQUEST_METRICS:
                objectives.append(Objective(key, parse_duration_s(value)))
            else:
                raise BenchError(
                    f"unknown objective {key!r}: per request {tuple(PER_REQUEST_METRICS)}, "
                    f"or pooled pNN_<metric> with metric in {POOLED_METRICS}"
                )
        return cls(tuple(objectives))


def meets(m: RequestMetrics, objset: ObjectiveSet) -> bool:
    for o in objset.objectives:
        value = getattr(m, PER_REQUEST_METRICS[o.metric])
        if value is not None and value > o.limit_s:
            return False
    return True


def evaluate(
    objset: ObjectiveSet,
    completed: Sequence[RequestMetrics],
    pooled: dict[str, list[float]],
    num_measured: int,
    window_s: float,
) -> dict:
    """Goodput and pass/fail of one objective set over a run's measured requests."""
    out: dict = {"name": objset.name, "style": objset.style, "window_s": window_s}
    rate = (lambda n: n / window_s) if window_s > 0 else (lambda n: None)
    if objset.style == "per-request":
        num_met = sum(meets(m, objset) for m in completed)
        out |= {
            "num_met": num_met,
            "num_measured": num_measured,
            "attainment": num_met / num_measured if num_measured else None,
            "goodput_rps": rate(num_met),
        }
        return out
    values = []
    for o in objset.objectives:
        samples = pooled[o.metric]
        value = percentile(samples, o.percentile)
        values.append(
            {
                "objective": o.describe(),
                "value_s": value,
                "num_samples": len(samples),
                "met": value <= o.limit_s if value is not None else bool(completed),
            }
        )
    met = all(v["met"] for v in values)
    out |= {"met": met, "values": values, "goodput_rps": rate(len(completed)) if met else 0.0}
    return out


def passes(result: dict, min_attainment: float) -> bool:
    """Whether an evaluated objective set passes: pooled `met`, or per-request attainment >=
    minimum."""
    if result["style"] == "pooled":
        return bool(result["met"])
    return result["attainment"] is not None and result["attainment"] >= min_attainment
