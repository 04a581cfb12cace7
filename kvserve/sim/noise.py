"""Step-cost noise: each simulated step's cost times a ratio drawn from the calibration's residuals.

A calibrated profile predicts the *mean* step time. Real steps scatter around it (other threads,
the HTTP side, caches, the OS), and that scatter is what makes latency tails: a deterministic step
cost flattens every p99. `NoisyCost` multiplies each step's predicted cost by a ratio
measured / predicted drawn (seeded, inverse CDF, linear between the stored percentiles) from the
fit's residual distribution, whose mean is 1 by construction of the fit, so means are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.core.outputs import SchedulerOutput
from kvserve.sim.cost import CostModel
from kvserve.sim.workload import SimError


@dataclass
class NoisyCost:
    """`base.step_s(...)` x a ratio drawn from `ratio_quantiles` (evenly spaced percentiles)."""

    base: CostModel
    ratio_quantiles: tuple[float, ...]
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        q = np.asarray(self.ratio_quantiles, dtype=float)
        if len(q) < 2 or not (np.diff(q) >= 0).all() or q[0] < 0:
            raise SimError("residual quantiles must be >= 2 non-decreasing, non-negative ratios")
        self._levels = np.linspace(0.0, 1.0, len(q))
        self._q = q
        self.reset()

    def reset(self) -> None:
        """Restart the draw sequence: every run of one simulation sees the same noise."""
        self._rng = np.random.default_rng(self.seed)

    @property
    def mean_ratio(self) -> float:
        """The mean of the interpolated distribution (trapezoids between percentiles)."""
        return float(np.trapezoid(self._q, self._levels))

    @property
    def request_overhead_s(self) -> float:
        return float(getattr(self.base, "request_overhead_s", 0.0))

    def draw(self) -> float:
        return float(np.interp(self._rng.random(), self._levels, self._q))

    def step_s(self, scheduler_output: SchedulerOutput) -> float:
        base_s = self.base.step_s(scheduler_output)
        return base_s * self.draw() if base_s > 0 else 0.0

    def describe(self) -> dict[str, Any]:
        q = self._q
        return self.base.describe() | {
            "noise": {
                "kind": "residual ratios, drawn per step",
                "seed": self.seed,
                "ratio_p1_p50_p99": [
                    float(np.interp(p, self._levels, q)) for p in (0.01, 0.5, 0.99)
                ],
                "mean_ratio": self.mean_ratio,
            }
        }
