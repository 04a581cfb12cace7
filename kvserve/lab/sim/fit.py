"""Fitting a step profile to timed steps, judging the fit, and the noise it leaves.

`fit_profile` fits non-negative per-feature step costs (IRLS on the error relative to the predicted
step time). `FitBound` says how poor a fit may be before calibration refuses to save it: a profile
that mispredicts the median step by more than its bound would mispredict every latency the
simulator reports. The fit's residuals (measured / predicted, per step) are kept as quantiles, so
that the simulator can draw step-to-step noise from them (`kvserve.lab.sim.noise`) and tails come out
of the model rather than being flattened (docs/simulator.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kvserve.lab.sim.cost import DEFAULT_FEATURES, StepLoad, StepProfile, feature_vector
from kvserve.lab.sim.noise import noise_class
from kvserve.lab.sim.workload import SimError

_NORMAL = NormalDist()

NUM_RESIDUAL_QUANTILES = 101  # 0th, 1st, ..., 100th percentile of measured / predicted
MIN_CLASS_STEPS = 40  # a step class keeps its own residual quantiles from this many steps on


class PoorFitError(SimError):
    """A calibration whose fit is worse than the stated bound (refused unless accepted)."""


@dataclass(frozen=True)
class FitBound:
    """The worst fit calibration saves without `--accept-poor-fit`: the median and the 90th
    percentile of |measured / predicted - 1| over the timed steps. On a quiet 2-core machine the
    demo model fits at a median of 10-15% and a p90 of ~30%; a loaded machine gave 418%."""

    max_median_abs_rel_error: float = 0.30
    max_p90_abs_rel_error: float = 0.75

    def __post_init__(self) -> None:
        if not (0 < self.max_median_abs_rel_error and 0 < self.max_p90_abs_rel_error):
            raise SimError("fit error bounds must be > 0")

    def violations(self, fit: dict) -> list[str]:
        """What is wrong with a fit (its `meta["fit"]`), in words; empty when within bounds."""
        out = []
        median, p90 = fit["median_abs_rel_error"], fit["p90_abs_rel_error"]
        if not median <= self.max_median_abs_rel_error:
            out.append(f"median |rel err| {median:.1%} > bound {self.max_median_abs_rel_error:.0%}")
        if not p90 <= self.max_p90_abs_rel_error:
            out.append(f"p90 |rel err| {p90:.1%} > bound {self.max_p90_abs_rel_error:.0%}")
        return out

    def check(self, fit: dict) -> None:
        bad = self.violations(fit)
        if bad:
            raise PoorFitError(
                f"the step-cost fit is poor ({'; '.join(bad)}, over {fit['num_steps']} steps): "
                "the machine was probably busy during calibration. Calibrate again on a quiet "
                "machine, with a longer --calibrate-budget-s, or pass --accept-poor-fit to save "
                "it anyway (the profile is then marked poor)."
            )


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| with x >= 0, by dropping the most negative coefficient and refitting until
    none is negative (enough for a handful of features; an exact NNLS would agree on
    well-conditioned data)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            return x
        free.pop(int(np.argmin(sol)))
    return x


def fit_profile(
    loads: list[StepLoad],
    times_s: list[float],
    features: tuple[str, ...] = DEFAULT_FEATURES,
    meta: dict | None = None,
    num_iterations: int = 10,
) -> StepProfile:
    """Fit non-negative per-feature costs by iteratively reweighted least squares on the error
    relative to the *predicted* step time: every step weighs alike whatever its length (the many
    short decode steps set ITL, the few long prompt steps TTFT), and the fit stays the mean step
    time. Weighting by the measured time instead would favour the fast samples of a noisy machine
    and predict every step too short. `meta["fit"]` reports the error and keeps the residual
    quantiles."""
    if len(loads) != len(times_s) or len(loads) < len(features):
        raise SimError(f"need at least {len(features)} timed steps, got {len(loads)}")
    y = np.asarray(times_s, dtype=float)
    if not (y > 0).all():
        raise SimError("every timed step must take > 0 s")
    x = np.asarray([feature_vector(s, features) for s in loads], dtype=float)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale

    def solve(weights: np.ndarray) -> np.ndarray:
        return nonnegative_lstsq(xs * weights[:, None], y * weights) / scale

    coef = solve(1.0 / y)
    for _ in range(num_iterations):
        coef = solve(1.0 / np.maximum(x @ coef, 1e-3 * y.min()))
    pred = np.maximum(x @ coef, 1e-3 * y.min())
    ratio = y / pred
    rel = np.abs(ratio - 1)
    fit = {
        "method": "IRLS, weights 1 / predicted step time, non-negative",
        "num_steps": len(y),
        "mean_measured_over_predicted": float(ratio.mean()),
        "median_abs_rel_error": float(np.median(rel)),
        "p90_abs_rel_error": float(np.percentile(rel, 90)),
        "max_abs_rel_error": float(rel.max()),
        "r2": float(1 - ((pred - y) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-300)),
        # measured / predicted at percentiles 0, 1, ..., 100: the step-cost noise
        "residual_ratio_quantiles": _quantiles(ratio),
    } | residual_structure(loads, ratio)
    return StepProfile(tuple(features), tuple(float(c) for c in coef), (meta or {}) | {"fit": fit})


def _quantiles(ratio: np.ndarray) -> list[float]:
    return [float(q) for q in np.percentile(ratio, np.linspace(0, 100, NUM_RESIDUAL_QUANTILES))]


def residual_structure(loads: list[StepLoad], ratio: np.ndarray) -> dict:
    """The residuals per step class (kvserve.lab.sim.noise.noise_class; classes with at least
    MIN_CLASS_STEPS steps) and the lag-1 correlation of consecutive steps' normal scores (each
    ratio's rank within its class mapped through the normal quantile function), in the order the
    steps were timed."""
    names = np.array([noise_class(s) for s in loads])
    by_class, scores = {}, np.zeros(len(ratio))
    for name in sorted(set(names)):
        mask = names == name
        r = ratio[mask]
        # mid-ranks within the class -> levels in (0, 1) -> normal scores
        ranks = (np.argsort(np.argsort(r, kind="stable"), kind="stable") + 0.5) / len(r)
        scores[mask] = [_NORMAL.inv_cdf(float(u)) for u in ranks]
        if mask.sum() >= MIN_CLASS_STEPS:
            by_class[name] = {"num_steps": int(mask.sum()), "quantiles": _quantiles(r)}
    rho = 0.0
    if len(ratio) > 2 and scores[:-1].std() > 0 and scores[1:].std() > 0:
        rho = float(np.clip(np.corrcoef(scores[:-1], scores[1:])[0, 1], -0.99, 0.99))
    return {"residual_ratio_quantiles_by_class": by_class, "residual_lag1_correlation": rho}


def judge_fit(profile: StepProfile, bound: FitBound, accept_poor: bool) -> list[str]:
    """Refuse a poor fit (PoorFitError) unless `accept_poor`; an accepted poor fit is marked in the
    profile (`meta["fit"]["poor"]`). Returns the violations (empty for a good fit)."""
    fit = profile.meta["fit"]
    bad = bound.violations(fit)
    fit["bound"] = {
        "max_median_abs_rel_error": bound.max_median_abs_rel_error,
        "max_p90_abs_rel_error": bound.max_p90_abs_rel_error,
    }
    fit["poor"] = bool(bad)
    fit["violations"] = bad
    if bad and not accept_poor:
        bound.check(fit)
    return bad
