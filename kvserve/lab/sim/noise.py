"""Step-cost noise: each simulated step's cost times a ratio drawn from the calibration's residuals.

A calibrated profile predicts the *mean* step time. Real steps scatter around it (other threads,
the HTTP side, caches, the OS), and that scatter is what makes latency tails: a deterministic step
cost flattens every p99. `NoisyCost` multiplies each step's predicted cost by a ratio
measured / predicted drawn (seeded, inverse CDF, linear between the stored percentiles) from the
fit's residual distribution.

Two properties of the measured residuals matter (docs/simulator.md, "Step noise"):

- **The scatter depends on the kind of step.** On the 2-core server, one-sequence decode steps
  scatter by +-50% at p1/p99 while prompt steps stay within ~25%; drawing a decode step's tail
  for a prompt step inflated TTFT p99 by ~20%, and the saturated run's wide tails inflated the
  light run's ITL p99 by ~20%. So residuals are kept per step class (`noise_class`) and a step
  draws from its own class (the pooled distribution where a class had too few steps).
- **It is correlated in time.** A slow step is followed by a slow step (the machine's other
  load comes and goes): consecutive residuals' normal scores correlate at ~0.7. The draws follow
  a Gaussian AR(1) of that lag-1 correlation mapped through each class's quantiles (a Gaussian
  copula): the marginals are exactly the measured ones and slow spells last as long as measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from kvserve.core.outputs import SchedulerOutput
from kvserve.lab.sim.cost import CostModel, StepLoad, step_kind
from kvserve.lab.sim.delivery import DeliveryJitter
from kvserve.lab.sim.workload import SimError

_NORMAL = NormalDist()

# Decode-only steps are classed by their number of sequences: [1], [2, 4), [4, 8), [8, 16), 16+.
_DECODE_BUCKETS = (1, 2, 4, 8, 16)


def noise_class(load: StepLoad) -> str:
    """The residual class of a step: `prefill` when any chunk is a prompt chunk (prompt-only and
    mixed steps: their cost is mostly the prompt's), else `decode-N` for decode-only steps with N
    the lower edge of their sequence-count bucket (1, 2, 4, 8, 16)."""
    if step_kind(load) == "prefill":
        return "prefill"
    edge = max(b for b in _DECODE_BUCKETS if b <= max(load.num_seqs, 1))
    return f"decode-{edge}"


def nearest_class(name: str, available: set[str]) -> str | None:
    """The stored class a step of class `name` draws from: itself, else the nearest decode bucket
    (decode classes only; a prefill step without its class uses the pooled residuals)."""
    if name in available:
        return name
    if not name.startswith("decode-"):
        return None
    edge = int(name.removeprefix("decode-"))
    decode = [int(c.removeprefix("decode-")) for c in available if c.startswith("decode-")]
    if not decode:
        return None
    return f"decode-{min(decode, key=lambda e: (abs(np.log2(e) - np.log2(edge)), e))}"


def _check_quantiles(q: tuple[float, ...]) -> np.ndarray:
    arr = np.asarray(q, dtype=float)
    if len(arr) < 2 or not (np.diff(arr) >= 0).all() or arr[0] < 0:
        raise SimError("residual quantiles must be >= 2 non-decreasing, non-negative ratios")
    return arr


@dataclass
class NoisyCost:
    """`base.step_s(...)` x a ratio drawn from `ratio_quantiles` (evenly spaced percentiles), or
    from the step's class in `class_quantiles` when given; `lag1_correlation` correlates
    consecutive draws (0: independent)."""

    base: CostModel
    ratio_quantiles: tuple[float, ...]
    seed: int = 0
    class_quantiles: dict[str, tuple[float, ...]] = field(default_factory=dict)
    lag1_correlation: float = 0.0
    delivery: DeliveryJitter | None = None  # per-token delivery jitter (kvserve.lab.sim.delivery)
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._q = _check_quantiles(self.ratio_quantiles)
        self._levels = np.linspace(0.0, 1.0, len(self._q))
        self._by_class = {k: _check_quantiles(v) for k, v in self.class_quantiles.items()}
        if not -1 < self.lag1_correlation < 1:
            raise SimError("the residuals' lag-1 correlation must be in (-1, 1)")
        self.reset()

    def reset(self) -> None:
        """Restart the draw sequence: every run of one simulation sees the same noise."""
        self._rng = np.random.default_rng(self.seed)
        self._z = float(self._rng.standard_normal())
        if self.delivery is not None:
            self.delivery.reset()

    @property
    def mean_ratio(self) -> float:
        """The mean of the pooled interpolated distribution (trapezoids between percentiles)."""
        return float(np.trapezoid(self._q, self._levels))

    @property
    def request_overhead_s(self) -> float:
        return float(getattr(self.base, "request_overhead_s", 0.0))

    @property
    def pickup_s(self) -> float:
        return float(getattr(self.base, "pickup_s", 0.0))

    def _level(self) -> float:
        """The next draw's level in [0, 1]: independent, or the AR(1) state's normal CDF."""
        rho = self.lag1_correlation
        if rho == 0.0:
            return float(self._rng.random())
        self._z = rho * self._z + float(np.sqrt(1 - rho * rho) * self._rng.standard_normal())
        return _NORMAL.cdf(self._z)

    def quantiles_for(self, load: StepLoad | None) -> np.ndarray:
        if load is None or not self._by_class:
            return self._q
        name = nearest_class(noise_class(load), set(self._by_class))
        return self._q if name is None else self._by_class[name]

    def draw(self, load: StepLoad | None = None) -> float:
        q = self.quantiles_for(load)
        return float(np.interp(self._level(), np.linspace(0.0, 1.0, len(q)), q))

    def step_s(self, scheduler_output: SchedulerOutput) -> float:
        base_s = self.base.step_s(scheduler_output)
        if base_s <= 0:
            return 0.0
        return base_s * self.draw(StepLoad.of(scheduler_output))

    def describe(self) -> dict[str, Any]:
        def summary(q: np.ndarray) -> list[float]:
            levels = np.linspace(0.0, 1.0, len(q))
            return [float(np.interp(p, levels, q)) for p in (0.01, 0.5, 0.99)]

        return (
            self.base.describe()
            | {
                "noise": {
                    "kind": "residual ratios, drawn per step"
                    + (", per step class" if self._by_class else "")
                    + (", AR(1)-correlated" if self.lag1_correlation else ""),
                    "seed": self.seed,
                    "ratio_p1_p50_p99": summary(self._q),
                    "ratio_p1_p50_p99_by_class": {k: summary(v) for k, v in self._by_class.items()},
                    "lag1_correlation": self.lag1_correlation,
                    "mean_ratio": self.mean_ratio,
                }
            }
            | ({"delivery_jitter": self.delivery.describe()} if self.delivery else {})
        )
