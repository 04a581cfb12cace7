"""The decode step from a measured engine profile (docs/planning.md, "A measured engine profile").

The roofline says a decode step streams W + B k t bytes at the GEMV bandwidth. On a CPU the engine
does not: its small-batch linear kernels stream weights slower than a GEMV as the batch grows, and
every layer pays a host cost (Python, op dispatch) that no byte count sees: on the 2-core EPYC a
SmolLM2-135M fp32 step took 1.7-3.8x the roofline. `kvserve plan --measure` times the engine's own
linear module per weight format and batch size, and its own decoder at a tiny width (the host
cost per layer and per forward); with those points the planner's step is

    step(B, t) = sum over weight categories of bytes / rate_fmt(B)     (linears and head)
               + B k t / rate_attention(B)                          (the KV cache)
               + L x layer_dispatch(B) + forward_fixed(B)             (host cost)

floored by the FLOPs at the measured peak. Rates and host costs are interpolated in log2(B)
between the measured batch sizes and held constant beyond them. A format without linear points
streams at the GEMV bandwidth, and the cache without attention points too (the plan says which
number each term uses in `sources`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.plan import arith
from kvserve.plan.formats import WeightFormat
from kvserve.plan.hardware import HardwareProfile
from kvserve.plan.model import ModelSpec


def _interp_log2(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Linear in log2(x) between measured (x, y) points, constant beyond the ends."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            f = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + f * (y1 - y0)
    return pts[-1][1]


@dataclass(frozen=True)
class EngineCost:
    """A decode-step model from measured engine points, for one model and weight format."""

    model: ModelSpec
    bytes_by_format: tuple[tuple[str, float], ...]  # (tensor format name, bytes) of W
    kv_bytes_per_token: float
    bandwidth_bytes_per_s: float  # GEMV: the KV cache and formats without linear points
    peak_flops_per_s: float
    linear_rates: dict[str, tuple[tuple[int, float], ...]]  # format -> (rows, bytes/s)
    layer_dispatch_s: tuple[tuple[int, float], ...]  # (rows, seconds per layer)
    forward_fixed_s: tuple[tuple[int, float], ...]  # (rows, seconds per forward)
    attention_rates: tuple[tuple[int, float], ...] = ()  # (rows, KV bytes/s); () = GEMV

    @classmethod
    def from_profile(
        cls,
        model: ModelSpec,
        fmt: WeightFormat,
        kv_bytes_per_token: float,
        hardware: HardwareProfile,
        bandwidth_bytes_per_s: float | None = None,
    ) -> EngineCost | None:
        """None when the profile has no dispatch points (a datasheet or an older measurement)."""
        rates: dict[str, list[tuple[int, float]]] = {}
        dispatch, fixed, attention = [], [], []
        for p in hardware.points:
            if p.kind.startswith("linear:"):
                rates.setdefault(p.kind.removeprefix("linear:"), []).append(
                    (p.num_columns, p.bytes_per_s)
                )
            elif p.kind == "dispatch":
                dispatch.append((p.num_columns, p.median_s))
            elif p.kind == "dispatch-fixed":
                fixed.append((p.num_columns, p.median_s))
            elif p.kind == "attention":
                attention.append((p.num_columns, p.bytes_per_s))
        if not dispatch or not fixed:
            return None
        by_format: dict[str, float] = {}
        for category, num_bytes in fmt.bytes_by_category(model).items():
            name = fmt.for_category(category).name
            by_format[name] = by_format.get(name, 0.0) + num_bytes
        return cls(
            model,
            tuple(sorted(by_format.items())),
            kv_bytes_per_token,
            bandwidth_bytes_per_s or hardware.bandwidth_bytes_per_s,
            hardware.peak_flops_per_s,
            {k: tuple(v) for k, v in rates.items()},
            tuple(dispatch),
            tuple(fixed),
            tuple(attention),
        )

    def terms_s(self, batch: float, mean_context: float) -> dict[str, float]:
        """The step's parts in seconds: weights, kv, dispatch, and the FLOPs floor (compute)."""
        weights = 0.0
        for name, num_bytes in self.bytes_by_format:
            rate = self.linear_rates.get(name)
            weights += num_bytes / (
                _interp_log2(rate, batch) if rate else self.bandwidth_bytes_per_s
            )
        kv_rate = (
            _interp_log2(self.attention_rates, batch)
            if self.attention_rates
            else self.bandwidth_bytes_per_s
        )
        kv = batch * self.kv_bytes_per_token * mean_context / kv_rate
        dispatch = self.model.num_layers * _interp_log2(self.layer_dispatch_s, batch)
        dispatch += _interp_log2(self.forward_fixed_s, batch)
        flops = arith.decode_step_flops(self.model, batch, mean_context)
        return {
            "weights": weights,
            "kv": kv,
            "dispatch": dispatch,
            "compute": flops / self.peak_flops_per_s,
        }

    def decode_step_s(self, batch: float, mean_context: float) -> float:
        t = self.terms_s(batch, mean_context)
        return max(t["weights"] + t["kv"] + t["dispatch"], t["compute"])

    def decode_bound(self, batch: float, mean_context: float) -> str:
        """ "memory" (weights + KV streaming is the largest part), "dispatch" (host cost is) or
        "compute" (the FLOPs floor sets the step)."""
        t = self.terms_s(batch, mean_context)
        if t["compute"] >= t["weights"] + t["kv"] + t["dispatch"]:
            return "compute"
        return "memory" if t["weights"] + t["kv"] >= t["dispatch"] else "dispatch"

    def sources(self) -> dict[str, str]:
        """Which measured number each term uses (the plan prints it)."""
        out = {}
        for name, _ in self.bytes_by_format:
            out[f"weights ({name})"] = (
                "the engine's linear kernel, measured per batch size"
                if name in self.linear_rates
                else "GEMV bandwidth (no linear points for this format)"
            )
        out["kv"] = (
            "the engine's decode attention, measured per batch size"
            if self.attention_rates
            else "GEMV bandwidth"
        )
        out["dispatch"] = "the engine's decoder at a tiny width, per layer and per forward"
        return out
