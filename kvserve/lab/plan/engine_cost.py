"""The decode step from a measured engine profile (docs/planning.md, "A measured engine profile").

The roofline says a decode step streams W + B k t bytes at the GEMV bandwidth. On a CPU the engine
does not: its small-batch linear kernels stream weights slower than a GEMV as the batch grows, and
every layer pays a host cost (Python, op dispatch) that no byte count sees. `kvserve plan --measure`
times the engine's own kernels for each step shape the engine runs (kvserve/lab/measure_engine.py), and
with those points the planner's step is

    step(B, t) = sum over weight categories of bytes / rate_fmt(B)     (linears and head)
               + L x attention_excess(B, t)                         (the KV cache read)
               + L x layer_host(B) + step_host(B)                   (host cost)
               + engine(B)                      (the engine's work outside the forward)

floored by the FLOPs at the measured peak. Three step shapes (the path the engine takes):

- **pooled** (B <= the fused step's rows: the profile's `decode_fused_f32_rows` (64 since the small-steps change; 16 in older profiles), for fp32 and
  quantised projections alike; an fp32 or 8-bit KV cache; more than one
  thread): every layer in one native call running as one OpenMP region (decode_step.c's pooled
  step, at every context: the pool's threads split the attention themselves); host cost `fused-dispatch`,
  `fused-fixed`;
- **fork** (profiles of an older kernel, `decode_pooled_values`: the fused step above that many
  cached values forked its own threads): one native call that opens a parallel region per
  linear; host cost `fork-dispatch`, `fork-fixed`; both fused paths stream fp32 weights with the
  panel GEMV (the `linear:FMT` points at <= decode_fused_rows rows, `linear-fused:fp32` above);
- **per-op** (larger B, or a quantised KV cache): one dispatched call per op (`dispatch`,
  `dispatch-fixed`), the batched linear kernels (the `linear:FMT` points above those rows).

On the pooled path a profile measured with a model (`pool-layer:FMT`, kvserve/lab/measure_pool.py) prices
the block linears and the cache read from the pooled step's own time per layer on the model's shapes
(the line through two contexts: its no-context value and its slope per cached token), host cost
included, instead of from kernels timed alone; the head streams at `head:FMT` (the head module
itself) where measured.

`engine(B)` is measured on the real engine (kvserve/lab/measure_overhead.py): the sampler
(`engine-sample`), the runner outside the forward (`engine-runner`) and the scheduler, output
processing and step loop (`engine-loop`), seconds per step at each row count.

Rates and host costs are interpolated in log2(B) between the measured batch sizes of the step's
own shape and held constant beyond them. The cache read is the engine's decode attention timed at
each measured context (`attention-time`: seconds per layer at rows B, context t), less its
zero-context intercept (the per-call cost the host terms count), linear in t between and beyond
the measured contexts. Older profiles still load: without fused points every step is priced on
the per-op points, without attention-time points the cache streams at the measured attention rate
(`attention`) or the GEMV bandwidth; `sources()` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.lab.plan import arith
from kvserve.lab.plan.engine_points import (
    Points,
    _interp_log2,
    _pool_layer_fit,
    _side,
    _timed_as_planned,
    attention_excess_s,
)
from kvserve.lab.plan.formats import WeightFormat
from kvserve.lab.plan.hardware import HardwareProfile
from kvserve.lab.plan.model import ModelSpec

__all__ = ["ENGINE_PARTS", "ENGINE_PART_NAMES", "EngineCost", "attention_excess_s"]

ENGINE_PART_NAMES = {
    "engine-sample": "the sampler",
    "engine-runner": "the runner's inputs and outputs",
    "engine-loop": "the scheduler, output processing and step loop",
}
ENGINE_PARTS = tuple(ENGINE_PART_NAMES)
# weight formats the engine runs on its fp32 kernels (`bf16`: bf16 products, its own kernel at every
# row count; docs/planning.md)
FP32_KERNEL = ("fp32", "fp16")


@dataclass(frozen=True)
class EngineCost:
    """A decode-step model from measured engine points, for one model and weight format."""

    model: ModelSpec
    bytes_by_format: tuple[tuple[str, float], ...]  # (tensor format name, bytes) of W
    kv_bytes_per_token: float
    bandwidth_bytes_per_s: float  # GEMV: the memory-bound ideal; formats without linear points
    peak_flops_per_s: float
    linear_rates: dict[str, Points]  # format -> (rows, bytes/s)
    layer_dispatch_s: Points  # per-op path: (rows, seconds per layer)
    forward_fixed_s: Points  # per-op path: (rows, seconds per forward)
    attention_rates: Points = ()  # (rows, KV bytes/s); () = GEMV
    fused_rows: int = 0  # steps of at most this many rows run fused (0: none)
    fused_layer_s: Points = ()  # fused path: (rows, seconds per layer)
    fused_fixed_s: Points = ()  # fused path: (rows, seconds per step outside the layers)
    attention_times: tuple[tuple[int, Points], ...] = ()  # (rows, ((context, s per layer), ...))
    small_rows: int = 0  # the linear kernels change above this many rows (0: one kernel)
    fork_layer_s: Points = ()  # fused step, forking path: (rows, seconds per layer)
    fork_fixed_s: Points = ()  # fused step, forking path: (rows, seconds per step)
    pooled_values: int = 0  # pooled while rows x context x KV heads x head_dim < this (0: none)
    engine_parts: tuple[tuple[str, Points], ...] = ()  # (engine-* kind, (rows, s per step))
    pooled_any_context: bool = False  # the fused step is the pooled step at every context
    fused_linear_rates: tuple[tuple[str, Points], ...] = ()  # panel GEMV above small_rows
    category_bytes: tuple[tuple[str, str, float], ...] = ()  # (category, format name, bytes)
    # the pooled step's own layers on the model's shapes, per block-linear format: (rows, seconds
    # per layer at no context, seconds per layer per cached token), scaled to this model
    pool_layers: tuple[tuple[str, tuple[tuple[int, float, float], ...]], ...] = ()
    head_rates: tuple[tuple[str, Points], ...] = ()  # the head module: format -> (rows, bytes/s)
    # block-linear formats whose pooled layers were timed on this plan's own layer and K/V bytes
    # (not scaled from another model's shapes or KV dtype): their steps were timed whole
    pool_as_planned: tuple[str, ...] = ()

    @classmethod
    def from_profile(
        cls,
        model: ModelSpec,
        fmt: WeightFormat,
        kv_bytes_per_token: float,
        hardware: HardwareProfile,
        bandwidth_bytes_per_s: float | None = None,
        fused_eligible: bool = True,
    ) -> EngineCost | None:
        """None when the profile has no dispatch points (a datasheet or an older measurement).
        `fused_eligible`: whether the engine can run this plan's decode steps fused (it needs an
        fp32 or 8-bit KV cache; docs/planning.md).

        Long: each fitted term read from the profile next to its fallback."""
        rates: dict[str, list[tuple[int, float]]] = {}
        fused_rates: dict[str, list[tuple[int, float]]] = {}
        by_kind: dict[str, list[tuple[int, float]]] = {}
        times: dict[int, list[tuple[int, float]]] = {}
        pool_raw: dict[str, list] = {}
        head: dict[str, list[tuple[int, float]]] = {}
        for p in hardware.points:
            if p.kind.startswith("linear:"):
                fmt_name = p.kind.removeprefix("linear:")
                rates.setdefault(fmt_name, []).append((p.num_columns, p.bytes_per_s))
            elif p.kind.startswith("linear-fused:"):
                fmt_name = p.kind.removeprefix("linear-fused:")
                fused_rates.setdefault(fmt_name, []).append((p.num_columns, p.bytes_per_s))
            elif p.kind == "attention-time":
                # timed on another model's cache: the read scales with the bytes per token
                scale = (
                    kv_bytes_per_token / (model.num_layers * p.kv_token_bytes)
                    if p.kv_token_bytes
                    else 1.0
                )
                times.setdefault(p.num_columns, []).append((p.context_tokens, p.median_s * scale))
            elif p.kind.startswith("pool-layer:"):
                pool_raw.setdefault(p.kind.removeprefix("pool-layer:"), []).append(p)
            elif p.kind.startswith("head:"):
                head.setdefault(p.kind.removeprefix("head:"), []).append(
                    (p.num_columns, p.bytes_per_s)
                )
            elif p.kind == "attention":
                by_kind.setdefault(p.kind, []).append((p.num_columns, p.bytes_per_s))
            else:
                by_kind.setdefault(p.kind, []).append((p.num_columns, p.median_s))
        dispatch, fixed = by_kind.get("dispatch", []), by_kind.get("dispatch-fixed", [])
        if not dispatch or not fixed:
            return None
        fused_layer, fused_fixed = by_kind.get("fused-dispatch", []), by_kind.get("fused-fixed", [])
        fused_rows = 0
        if fused_layer and fused_fixed:  # as many rows for quantised projections as for fp32 ones
            fused_rows = hardware.decode_fused_f32_rows or hardware.decode_fused_rows
        parts = tuple((kind, tuple(by_kind[kind])) for kind in ENGINE_PARTS if by_kind.get(kind))
        by_format: dict[str, float] = {}
        category_bytes = []
        for category, num_bytes in fmt.bytes_by_category(model).items():
            name = fmt.for_category(category).name
            by_format[name] = by_format.get(name, 0.0) + num_bytes
            category_bytes.append((category, name, num_bytes))
        layer_bytes = fmt.bytes_by_category(model)["linear"] / model.num_layers
        kv_layer = kv_bytes_per_token / model.num_layers
        pooled = {
            name: _pool_layer_fit(pts, layer_bytes, kv_layer) for name, pts in pool_raw.items()
        }
        as_planned = tuple(
            sorted(
                name
                for name, pts in pool_raw.items()
                if _timed_as_planned(pts, layer_bytes, kv_layer)
            )
        )
        return cls(
            model,
            tuple(sorted(by_format.items())),
            kv_bytes_per_token,
            bandwidth_bytes_per_s or hardware.bandwidth_bytes_per_s,
            hardware.peak_flops_per_s,
            {k: tuple(v) for k, v in rates.items()},
            tuple(dispatch),
            tuple(fixed),
            tuple(by_kind.get("attention", [])),
            fused_rows if fused_eligible else 0,
            tuple(fused_layer),
            tuple(fused_fixed),
            tuple((rows, tuple(sorted(pts))) for rows, pts in sorted(times.items())),
            hardware.decode_fused_rows,
            tuple(by_kind.get("fork-dispatch", [])),
            tuple(by_kind.get("fork-fixed", [])),
            hardware.decode_pooled_values,
            parts,
            hardware.decode_pooled_any_context,
            tuple((k, tuple(v)) for k, v in sorted(fused_rates.items())),
            tuple(category_bytes),
            tuple(sorted((k, v) for k, v in pooled.items() if v)),
            tuple((k, tuple(sorted(v))) for k, v in sorted(head.items())),
            as_planned,
        )

    def path(self, batch: float, mean_context: float | None = None) -> str:
        """The step shape the engine runs for `batch` decode rows at `mean_context`: "pooled" (the
        fused step as one region), "fork" (the fused step, a region per linear), "per-op", or
        "fused" (a profile that does not tell the fused step's two paths apart)."""
        if not (self.fused_rows and batch <= self.fused_rows):
            return "per-op"
        if self.pooled_any_context:
            return "pooled"
        if not self.pooled_values or mean_context is None:
            return "fused"
        values = batch * mean_context * self.model.num_kv_heads * self.model.head_dim
        return "pooled" if values < self.pooled_values else "fork"

    def _host_points(self, path: str) -> tuple[Points, Points]:
        if path == "fork" and self.fork_layer_s and self.fork_fixed_s:
            return self.fork_layer_s, self.fork_fixed_s
        if path in ("pooled", "fork", "fused"):
            return self.fused_layer_s, self.fused_fixed_s
        return self.layer_dispatch_s, self.forward_fixed_s  # all per-op points

    @property
    def _linear_format(self) -> str | None:
        """This plan's block-linear format (None in a profile without categories)."""
        return next((n for c, n, _ in self.category_bytes if c == "linear"), None)

    def _pool_layer(self, path: str) -> tuple[tuple[int, float, float], ...]:
        """The pooled step's measured layers for this plan's block-linear format on the pooled path
        (() otherwise, or in a profile without them)."""
        if path != "pooled":
            return ()
        return dict(self.pool_layers).get(self._linear_format, ())

    def engine_terms_s(self, batch: float) -> dict[str, float]:
        """The engine's per-step work outside the forward, by part (seconds; {} if not measured)."""
        return {kind: _interp_log2(pts, batch) for kind, pts in self.engine_parts}

    def _kv_s(self, batch: float, mean_context: float) -> float:
        if self.attention_times:
            per_rows = tuple(
                (rows, attention_excess_s(pts, mean_context)) for rows, pts in self.attention_times
            )
            return self.model.num_layers * _interp_log2(per_rows, batch)
        kv_rate = (
            _interp_log2(self.attention_rates, batch)
            if self.attention_rates
            else self.bandwidth_bytes_per_s
        )
        return batch * self.kv_bytes_per_token * mean_context / kv_rate

    def terms_s(self, batch: float, mean_context: float) -> dict[str, float]:
        """The step's parts in seconds: weights, kv, dispatch, the FLOPs floor (compute), and
        `bandwidth`: the weights and cache at the GEMV bandwidth (the memory-bound ideal);
        `engine`: the engine outside the forward (0 when the profile did not measure it)."""
        path = self.path(batch, mean_context)
        fused_rates = dict(self.fused_linear_rates)
        pooled = self._pool_layer(path)
        heads = dict(self.head_rates)
        weights, kv = 0.0, None
        parts = self.category_bytes or tuple(("", n, b) for n, b in self.bytes_by_format)
        for category, name, num_bytes in parts:
            if pooled and category == "linear":  # the pooled step's own layers (docs/planning.md)
                w_s = _interp_log2(tuple((r, w) for r, w, _ in pooled), batch)
                per_token = _interp_log2(tuple((r, k) for r, _, k in pooled), batch)
                weights += self.model.num_layers * w_s
                kv = self.model.num_layers * per_token * mean_context
                continue
            rate = self.linear_rates.get(name)
            head = category in ("embed", "head") and name in heads  # the head module itself
            if head:
                rate = heads[name]
            # in profiles measured before fp32 ran the panel GEMM at every row count, fp32 changed
            # kernel above `small_rows` (GEMV -> oneDNN) on the per-op path (today one kernel on
            # both sides: the split only uses fewer points); the fused
            # step keeps the panel GEMV up to its rows (`linear-fused:fp32`; without those points
            # the small-row rate held); int8 / int4 run the panel GEMV at every row count
            boundary = self.small_rows if name in FP32_KERNEL else 0
            if rate and boundary and path != "per-op" and batch > boundary and not head:
                small = tuple(p for p in rate if p[0] <= boundary) or rate
                rate = small + fused_rates.get(name, ())
                boundary = 0
            weights += num_bytes / (
                _interp_log2(_side(rate, batch, boundary), batch)
                if rate
                else self.bandwidth_bytes_per_s
            )
        layer, fixed = self._host_points(path)
        # the pooled layers' times hold their host cost: only the step's fixed part is added
        per_layer = 0.0 if pooled else _interp_log2(layer, batch)
        dispatch = self.model.num_layers * per_layer + _interp_log2(fixed, batch)
        flops = arith.decode_step_flops(self.model, batch, mean_context)
        total_bytes = sum(b for _, b in self.bytes_by_format)
        total_bytes += batch * self.kv_bytes_per_token * mean_context
        return {
            "weights": weights,
            "kv": self._kv_s(batch, mean_context) if kv is None else kv,
            "dispatch": dispatch,
            "engine": sum(self.engine_terms_s(batch).values()),
            "compute": flops / self.peak_flops_per_s,
            "bandwidth": total_bytes / self.bandwidth_bytes_per_s,
        }

    def _measured_whole(self, batch: float, mean_context: float) -> bool:
        """Whether the step's layers are the pooled step's own times on the model's shapes at no
        more rows than were timed, on this plan's own layer and K/V bytes: the FLOPs are then in
        the measurement, and the floor at the GEMM probe's peak (which the engine's int8, int4 and
        bf16-product kernels outrun) does not apply. Past the timed rows the points are held
        constant, and times scaled from other shapes or another KV dtype scale bytes, not FLOPs:
        the floor bounds those."""
        pooled = self._pool_layer(self.path(batch, mean_context))
        timed = bool(pooled) and self._linear_format in self.pool_as_planned
        return timed and batch <= max(r for r, _, _ in pooled)

    def decode_step_s(self, batch: float, mean_context: float) -> float:
        t = self.terms_s(batch, mean_context)
        summed = t["weights"] + t["kv"] + t["dispatch"] + t["engine"]
        return summed if self._measured_whole(batch, mean_context) else max(summed, t["compute"])

    def decode_bound(self, batch: float, mean_context: float) -> str:
        """The largest part of the step: "memory" (the weights and cache at the GEMV bandwidth),
        "kernel" (what the measured kernels take beyond that: kernel efficiency), "dispatch"
        (the forward's host cost), "engine" (the engine's work outside the forward), or
        "compute" (the FLOPs floor sets the step; never where the pooled step was timed whole at
        these rows)."""
        t = self.terms_s(batch, mean_context)
        streaming = t["weights"] + t["kv"]
        floored = not self._measured_whole(batch, mean_context)
        if floored and t["compute"] >= streaming + t["dispatch"] + t["engine"]:
            return "compute"
        memory = min(t["bandwidth"], streaming)
        parts = {
            "memory": memory,
            "kernel": streaming - memory,
            "dispatch": t["dispatch"],
            "engine": t["engine"],
        }
        return max(parts, key=parts.__getitem__)

    def sources(self) -> dict[str, str]:
        """Which measured number each term uses (the plan prints it)."""
        out = {}
        for name, _ in self.bytes_by_format:
            if name not in self.linear_rates:
                out[f"weights ({name})"] = "GEMV bandwidth (no linear points for this format)"
            elif self.small_rows:
                out[f"weights ({name})"] = (
                    "the engine's linear kernel, measured per batch size (the small-row GEMV at "
                    f"<= {self.small_rows} rows, the batched kernel above)"
                )
            else:
                out[f"weights ({name})"] = "the engine's linear kernel, measured per batch size"
        for name, pts in self.pool_layers:
            out[f"pooled step ({name})"] = (
                f"on the pooled path the block linears ({name}) and the cache read are the pooled "
                "step's own time per layer on the model's shapes at rows "
                + ", ".join(str(r) for r, _, _ in pts)
                + " (its no-context part and its slope per cached token; host cost included)"
            )
        for name, pts in self.head_rates:
            out[f"head ({name})"] = "the head module timed at rows " + ", ".join(
                str(r) for r, _ in pts
            )
        if self.attention_times:
            contexts = sorted({c for _, pts in self.attention_times for c, _ in pts})
            out["kv"] = (
                "the engine's decode attention timed at contexts "
                + ", ".join(str(c) for c in contexts)
                + ", per batch size"
            )
        elif self.attention_rates:
            out["kv"] = "the engine's decode attention, measured per batch size"
        else:
            out["kv"] = "GEMV bandwidth"
        if self.fused_rows:
            if self.pooled_any_context:
                paths = "as one region at every context"
            elif self.pooled_values:
                paths = (
                    f"as one region below {self.pooled_values} cached values (rows x context x KV "
                    "heads x head_dim), "
                    + ("its forking path above" if self.fork_layer_s else "priced the same above")
                )
            else:
                paths = "one path"
            out["dispatch"] = (
                f"the fused decode step (<= {self.fused_rows} rows; {paths}) and the per-op "
                "decoder (more rows), each at a tiny width, per layer and per step"
            )
        else:
            out["dispatch"] = "the engine's decoder at a tiny width, per layer and per forward" + (
                ""
                if self.fused_layer_s
                else " (no fused-step points in this profile: every step priced per-op; "
                "re-measure with `kvserve plan --measure` for the fused decode step)"
            )
        if self.engine_parts:
            out["engine"] = (
                "the engine outside the forward, timed on the real engine per batch size: "
                + ", ".join(ENGINE_PART_NAMES[k] for k, _ in self.engine_parts)
            )
        else:
            out["engine"] = (
                "not measured (0): re-measure with `kvserve plan --measure --measure-model M` "
                "to count the sampler, runner and scheduler"
            )
        return out
