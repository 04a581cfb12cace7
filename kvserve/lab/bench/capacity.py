"""The highest arrival rate that meets the objectives: bracket, bisect, then check the neighbours.

A finite sample at one rate can pass while a lower rate fails (noise), so the answer is
conservative: the highest tested rate r such that every trial at every rate <= r passed. After
bisection the rates around the boundary are run again, and any non-monotonic outcome is reported
rather than hidden.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Trial:
    rate: float
    passed: bool
    detail: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class CapacityResult:
    capacity_rps: float | None  # None: even the lowest tested rate failed
    trials: tuple[Trial, ...]
    lower_bound_only: bool  # True: no tested rate up to max_rate failed
    non_monotonic: tuple[float, ...]  # rates that passed although that or a lower rate failed

    def to_json(self) -> dict:
        return {
            "capacity_rps": self.capacity_rps,
            "lower_bound_only": self.lower_bound_only,
            "non_monotonic_rates": list(self.non_monotonic),
            "trials": [{"rate": t.rate, "passed": t.passed} | t.detail for t in self.trials],
        }


def conservative_capacity(trials: tuple[Trial, ...]) -> float | None:
    """Highest tested rate r such that every trial at a rate <= r passed."""
    best = None
    for rate in sorted({t.rate for t in trials}):
        if all(t.passed for t in trials if t.rate <= rate):
            best = rate
        else:
            break
    return best


def find_capacity(
    evaluate: Callable[[float], Trial],
    start_rps: float = 1.0,
    max_rps: float = 1024.0,
    rel_tol: float = 0.1,
    max_trials: int = 16,
    min_rps: float | None = None,
) -> CapacityResult:
    if not (0 < start_rps <= max_rps and rel_tol > 0 and max_trials >= 3):
        raise ValueError("need 0 < start <= max, rel_tol > 0, max_trials >= 3")
    min_rps = min_rps if min_rps is not None else start_rps / 64
    trials: list[Trial] = []

    def run(rate: float) -> bool:
        trial = evaluate(rate)
        trials.append(trial)
        return trial.passed

    budget = max_trials - 3  # keep three trials for the neighbour checks
    lo: float | None = None
    hi: float | None = None
    rate = start_rps
    if run(rate):  # bracket upwards by doubling
        lo = rate
        while len(trials) < budget and rate * 2 <= max_rps:
            rate *= 2
            if not run(rate):
                hi = rate
                break
            lo = rate
    else:  # bracket downwards by halving
        hi = rate
        while len(trials) < budget and rate / 2 >= min_rps:
            rate /= 2
            if run(rate):
                lo = rate
                break
            hi = rate
    while lo is not None and hi is not None and hi / lo > 1 + rel_tol and len(trials) < budget:
        mid = math.sqrt(lo * hi)  # geometric: rates span orders of magnitude
        if run(mid):
            lo = mid
        else:
            hi = mid
    if lo is not None:  # neighbour checks: the boundary again, and one step below it
        run(lo)
        run(lo / (1 + rel_tol))
        if hi is not None:
            run(hi)
    result = tuple(trials)
    capacity = conservative_capacity(result)
    failed_rates = [t.rate for t in result if not t.passed]
    non_monotonic = tuple(
        sorted({t.rate for t in result if t.passed and any(f <= t.rate for f in failed_rates)})
    )
    return CapacityResult(
        capacity,
        result,
        lower_bound_only=hi is None and lo is not None,
        non_monotonic=non_monotonic,
    )
