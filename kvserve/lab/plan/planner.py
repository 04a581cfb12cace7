"""`make_plan`: model, formats, hardware, workload, prices, assumptions -> every plan number."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvserve.lab.plan import arith
from kvserve.lab.plan.engine_cost import ENGINE_PART_NAMES, EngineCost
from kvserve.lab.plan.figures import Latency, Load, Workload
from kvserve.lab.plan.formats import STANDARD_FORMATS, KVFormat, WeightFormat, parse_weight_format
from kvserve.lab.plan.hardware import HardwareProfile
from kvserve.lab.plan.model import ModelSpec, PlanError
from kvserve.lab.plan.parallel import (
    Parallelism,
    ParallelPlan,
    activation_bytes,
    parallel_plan,
    shard_model,
)

HOURS_PER_YEAR = 24 * 365

FUSED_KV_DTYPES = ("fp32", "int8", "fp8")  # KV caches the fused decode step takes


@dataclass(frozen=True)
class Assumptions:
    mfu: float = 0.5  # prefill model FLOP utilisation
    bandwidth_fraction: float | None = None  # None: 0.8 of a datasheet peak, 1.0 of a measured one
    overhead_bytes: float = 2e9  # runtime: CUDA context, activations, allocator slack
    utilisation: float | None = None  # None: what the stated volume keeps the devices busy

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise PlanError("MFU must be in (0, 1]")
        if self.bandwidth_fraction is not None and not 0 < self.bandwidth_fraction <= 1:
            raise PlanError("the bandwidth fraction must be in (0, 1]")
        if self.utilisation is not None and not 0 < self.utilisation <= 1:
            raise PlanError("utilisation must be in (0, 1]")
        if not 0 <= self.overhead_bytes < math.inf:  # NaN and negatives refused
            raise PlanError(
                f"the runtime overhead must be >= 0 GB, got {self.overhead_bytes / 1e9:g}"
            )

    def resolved(self, hardware: HardwareProfile) -> Assumptions:
        if self.bandwidth_fraction is not None:
            return self
        return replace(self, bandwidth_fraction=1.0 if hardware.measured else 0.8)


@dataclass(frozen=True)
class Prices:
    """A rental price per hour, or an owned device: purchase cost over its amortisation + power."""

    price_per_hour_usd: float | None = None
    device_cost_usd: float | None = None
    power_w: float | None = None  # None: the profile's
    electricity_usd_per_kwh: float = 0.15
    amortisation_years: float = 3.0

    def __post_init__(self) -> None:
        # no division by zero years; no negative prices or powers
        if not 0 < self.amortisation_years < math.inf:
            raise PlanError(f"amortisation years must be > 0, got {self.amortisation_years:g}")
        for name in ("price_per_hour_usd", "device_cost_usd", "power_w", "electricity_usd_per_kwh"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise PlanError(f"{name.replace('_', ' ')} must be >= 0, got {value:g}")

    def hourly_usd(self, hardware: HardwareProfile) -> tuple[float | None, str]:
        """(USD per device-hour, how it was derived). Owned devices pay full power every hour."""
        if self.price_per_hour_usd is not None:
            return self.price_per_hour_usd, "given"
        cost, origin = self.device_cost_usd, "given"
        if cost is None and hardware.price_per_hour_usd is not None:
            return hardware.price_per_hour_usd, "profile's illustrative reference rental price"
        if cost is None:
            cost, origin = hardware.device_cost_usd, "profile's illustrative reference price"
        if cost is None:
            return None, "no price: give --price-per-hour or --device-cost"
        power_w = self.power_w if self.power_w is not None else hardware.power_w or 0.0
        hourly = cost / (self.amortisation_years * HOURS_PER_YEAR)
        hourly += power_w / 1000 * self.electricity_usd_per_kwh
        return hourly, (
            f"owned, {origin}: ${cost:g} over {self.amortisation_years:g} y + {power_w:g} W "
            f"x ${self.electricity_usd_per_kwh:g}/kWh"
        )


@dataclass(frozen=True)
class FormatRow:
    name: str
    weight_bytes: float
    bits_per_weight: float  # effective, over all parameters, scales included
    linear_bits_per_weight: (
        float | None
    )  # nominal bits of the block linears' format (None: per-channel)


@dataclass(frozen=True)
class Intensity:
    """Arithmetic intensity in FLOPs per byte."""

    ridge: float  # peak / BW
    prefill: float
    decode_solo: float
    decode_max_batch: float | None
    weights_gemv: float  # 2 / (bytes per weight) of the block linears
    attention_decode: float  # 2 n_q / (n_kv b)


@dataclass(frozen=True)
class Cost:
    usd_per_hour: float | None
    price_source: str
    busy_hours_per_day: float
    num_devices: int
    utilisation: float
    utilisation_source: str
    usd_per_million_output: float | None
    usd_per_million_output_full_load: float | None
    devices_per_replica: int = 1  # tensor-parallel ranks: `num_devices` counts replicas of these


@dataclass(frozen=True)
class Little:
    """Little's law at the stated volume, per device: in system = arrival rate x time in system.

    `e2e_s` ignores queueing (the batch's step time at the concurrency it implies); the M/M/1
    figures inflate it by 1 / (1 - rho), rho = the device utilisation, to show how it explodes near
    saturation.
    """

    arrival_rate_per_s: float  # per device
    e2e_s: float
    mean_in_system: float
    utilisation: float  # rho
    e2e_mm1_s: float | None  # None when rho >= 1
    mean_in_system_mm1: float | None
    max_concurrent: int
    stable: bool


@dataclass(frozen=True)
class PlanResult:
    model: ModelSpec
    hardware: HardwareProfile
    weight_format: str
    kv_dtype: str
    workload: Workload
    assumptions: Assumptions
    prices: Prices
    num_params: int
    num_matmul_params: int
    weight_bytes: float
    bits_per_weight: float
    formats: tuple[FormatRow, ...]
    kv_bytes_per_value: float
    kv_bytes_per_token: float
    kv_bytes_per_request: float
    bandwidth_bytes_per_s: float  # effective: peak x fraction
    free_cache_bytes: float
    max_concurrent: int
    max_concurrent_shared_prefix: int
    latency: Latency
    intensity: Intensity
    load: Load | None
    cost: Cost | None
    little: Little | None
    notes: tuple[str, ...]
    parallel: ParallelPlan | None = None  # set when planned over more than one device

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hardware"].pop("points", None)
        data["model"]["num_params"] = self.num_params
        return data


def format_rows(model: ModelSpec, chosen: WeightFormat) -> tuple[FormatRow, ...]:
    names = list(STANDARD_FORMATS)
    if chosen.name not in names:
        names.append(chosen.name)
    fmts = [chosen if n == chosen.name else parse_weight_format(n) for n in names]
    return tuple(
        FormatRow(
            f.name,
            f.weight_bytes(model),
            f.bits_per_weight(model),
            f.linear.nominal_bits_per_weight,
        )
        for f in fmts
    )


def _little(
    w: Workload,
    ttft_s: float,
    cost: arith.RooflineCost,
    num_devices: int,
    max_concurrent: int,
    rho: float,
) -> Little:
    rate = w.requests_per_day / 86400 / num_devices
    t = w.mean_decode_context
    in_system = 0.0
    e2e_s = ttft_s + (w.output_tokens - 1) * cost.decode_step_s(1, t)
    for _ in range(200):  # fixed point: the batch is the number in system, which sets the step time
        in_system = rate * e2e_s
        if in_system > max_concurrent:
            break
        e2e_next = ttft_s + (w.output_tokens - 1) * cost.decode_step_s(max(1.0, in_system), t)
        if abs(e2e_next - e2e_s) <= 1e-9 * e2e_s:
            break
        e2e_s = e2e_next
    e2e_mm1 = e2e_s / (1 - rho) if rho < 1 else None
    in_mm1 = rate * e2e_mm1 if e2e_mm1 is not None else None
    stable = in_mm1 is not None and in_mm1 <= max_concurrent
    return Little(rate, e2e_s, in_system, rho, e2e_mm1, in_mm1, max_concurrent, stable)


def _engine_step_note(engine: EngineCost, context: float) -> str:
    """The solo decode step's measured parts, the engine outside the forward among them."""
    t, parts = engine.terms_s(1, context), engine.engine_terms_s(1)
    inside = ", ".join(f"{ENGINE_PART_NAMES[k]} {v * 1e3:.2f} ms" for k, v in parts.items())
    return (
        f"decode step at B=1, context {context:g} ({engine.path(1, context)} path): weights "
        f"{t['weights'] * 1e3:.2f} ms + cache {t['kv'] * 1e3:.2f} ms + host {t['dispatch'] * 1e3:.2f}"
        f" ms + engine outside the forward {t['engine'] * 1e3:.2f} ms"
        + (f" ({inside})" if inside else " (not measured)")
    )


def _remote_core(latency: Latency, message_s: float) -> Latency:
    """A request served by an engine core on another host: one message in before its prefill, one
    out with its first token; later deltas are as late as the first, so the gaps between them keep."""
    return replace(
        latency,
        ttft_cold_s=latency.ttft_cold_s + 2 * message_s,
        ttft_cached_s=latency.ttft_cached_s + 2 * message_s,
        e2e_solo_s=latency.e2e_solo_s + 2 * message_s,
    )


def _latency(cost: arith.RooflineCost, w: Workload, b_max: int, peak_bw: float) -> Latency:
    t, n_prompt, n_shared = w.mean_decode_context, w.prompt_tokens, w.shared_prefix_tokens
    ttft_cold = cost.prefill_s(n_prompt)
    solo = cost.decode_step_s(1, t)
    big = cost.decode_step_s(b_max, t) if b_max else None
    return Latency(
        ttft_cold_s=ttft_cold,
        ttft_cached_s=cost.prefill_s(n_prompt - n_shared, n_shared),
        tpot_solo_s=solo,
        tokens_per_s_solo=1 / solo,
        solo_bound=cost.decode_bound(1, t),
        e2e_solo_s=ttft_cold + (w.output_tokens - 1) * solo,
        tpot_max_batch_s=big,
        tokens_per_s_max_batch=b_max / big if big else None,
        per_sequence_tokens_per_s_max_batch=1 / big if big else None,
        max_batch_bound=cost.decode_bound(b_max, t) if b_max else None,
        aggregate_limit_tokens_per_s=arith.aggregate_decode_limit_tokens_per_s(
            cost.bandwidth_bytes_per_s, cost.kv_bytes_per_token, t
        ),
        estimated_mbu_solo=cost.decode_step_bytes(1, t) / solo / peak_bw,
    )


def _intensity(
    cost: arith.RooflineCost, fmt: WeightFormat, w: Workload, b_max: int, ridge: float, b: float
) -> Intensity:
    model, t = cost.model, w.mean_decode_context
    linear_params = sum(x.num_params for x in model.tensors() if x.category == "linear")
    linear_bytes = fmt.bytes_by_category(model)["linear"]
    prefill_bytes = arith.prefill_bytes(cost.weight_bytes, cost.kv_bytes_per_token, w.prompt_tokens)
    return Intensity(
        ridge=ridge,
        prefill=arith.prefill_flops(model, w.prompt_tokens) / prefill_bytes,
        decode_solo=cost.decode_intensity(1, t),
        decode_max_batch=cost.decode_intensity(b_max, t) if b_max else None,
        weights_gemv=arith.gemv_intensity(linear_bytes / linear_params),
        attention_decode=arith.attention_decode_intensity(model, b),
    )


def _economics(
    cost: arith.RooflineCost,
    w: Workload,
    a: Assumptions,
    prices: Prices,
    hardware: HardwareProfile,
    b_max: int,
    ttft_s: float,
    parallel: Parallelism | None = None,
) -> tuple[Load, Cost, Little]:
    n_prompt, n_out, n_shared = w.prompt_tokens, w.output_tokens, w.shared_prefix_tokens
    # At full load prefills run batched, so they pay compute only (weight reads are shared).
    prefill_load_s = cost.prefill_compute_s(n_prompt - n_shared, n_shared)
    device_s = (
        prefill_load_s + (n_out - 1) * cost.decode_step_s(b_max, w.mean_decode_context) / b_max
    )
    load = Load(device_s, 1 / device_s, n_out / device_s, prefill_load_s / device_s)
    busy_h = w.requests_per_day * device_s / 3600
    # One "device" below is one replica: a tensor-parallel group when --tensor-parallel N > 1.
    # --data-parallel M fixes the number of replicas; otherwise the volume decides.
    tp = parallel.tensor_parallel if parallel else 1
    fixed = parallel is not None and parallel.data_parallel > 1
    num_devices = parallel.data_parallel if fixed else max(1, math.ceil(busy_h / 24))
    rho = busy_h / (24 * num_devices)
    if a.utilisation is not None:
        util, util_source = a.utilisation, "given"
    elif w.requests_per_day == 0:
        util, util_source = 1.0, "no volume stated: full load"
    else:
        util = min(max(rho, 1e-12), 1.0)
        util_source = f"from {w.requests_per_day:g} requests/day on {num_devices} replica(s)"
    usd_h, price_source = prices.hourly_usd(hardware)
    if usd_h is not None and tp > 1:
        usd_h, price_source = usd_h * tp, f"{tp} x {price_source}"
    per_m = per_m_full = None
    if usd_h is not None:
        per_m_full = usd_h / (load.output_tokens_per_s * 3600) * 1e6
        per_m = per_m_full / util
    money = Cost(usd_h, price_source, busy_h, num_devices, util, util_source, per_m, per_m_full, tp)
    return load, money, _little(w, ttft_s, cost, num_devices, b_max, rho)


def _notes(
    model: ModelSpec,
    hardware: HardwareProfile,
    fmt: WeightFormat,
    w: Workload,
    weight_bytes: float,
    overhead_bytes: float,
    b_max: int,
) -> list[str]:
    notes = []
    if w.tokens_per_request > model.max_position_embeddings:
        notes.append(
            f"prompt + output = {w.tokens_per_request} exceeds the model's "
            f"max_position_embeddings ({model.max_position_embeddings})"
        )
    if weight_bytes + overhead_bytes > hardware.memory_bytes:
        notes.append("the weights and runtime overhead do not fit in memory")
    elif b_max == 0:
        notes.append("not one full-length request fits in the KV cache")
    if fmt.linear.is_float and fmt.linear.name != hardware.compute_dtype:
        notes.append(
            f"{hardware.name}'s peak is for {hardware.compute_dtype}; the plan applies it to "
            f"{fmt.linear.name} matmuls as given"
        )
    return notes


def make_plan(
    model: ModelSpec,
    hardware: HardwareProfile,
    weight_format: WeightFormat | str = "bf16",
    kv_dtype: str = "bf16",
    workload: Workload | None = None,
    assumptions: Assumptions | None = None,
    prices: Prices | None = None,
    parallel: Parallelism | None = None,
) -> PlanResult:
    """Every number of the plan (docs/planning.md) for one model, format, device and workload.

    With `parallel`, weights, KV, latency and capacity are per device / per replica: one
    tensor-parallel rank is `shard_model(model, N)` and every step pays its all-reduces
    (docs/parallel.md); `PlanResult.parallel` holds the totals.

    Long: the plan's numbers in the order docs/planning.md derives them."""
    fmt = parse_weight_format(weight_format) if isinstance(weight_format, str) else weight_format
    w = workload or Workload()
    a = (assumptions or Assumptions()).resolved(hardware)
    prices = prices or Prices()
    tp = parallel.tensor_parallel if parallel else 1
    rank = shard_model(model, tp)
    weight_bytes = fmt.weight_bytes(rank)
    b = KVFormat(kv_dtype).bytes_per_value(model.head_dim)
    k = arith.kv_bytes_per_token(rank, b)
    bw = hardware.bandwidth_bytes_per_s * a.bandwidth_fraction
    comm = parallel.comm(model, activation_bytes(fmt)) if parallel and tp > 1 else None
    engine = None
    if tp == 1:  # the measured engine profile is one device's (docs/planning.md)
        # the fused decode step takes an fp32 or 8-bit KV cache (kvserve/model/fused_decode.py)
        fused_kv = kv_dtype in FUSED_KV_DTYPES
        engine = EngineCost.from_profile(rank, fmt, k, hardware, bw, fused_kv)
    cost = arith.RooflineCost(
        rank, weight_bytes, k, bw, hardware.peak_flops_per_s, a.mfu, comm, engine
    )
    free = arith.free_cache_bytes(hardware.memory_bytes, weight_bytes, a.overhead_bytes)
    kv_request = arith.kv_bytes_per_sequence(rank, b, w.tokens_per_request)
    b_max = arith.max_concurrent_sequences(free, k, w.tokens_per_request, kv_request)
    notes = _notes(model, hardware, fmt, w, weight_bytes, a.overhead_bytes, b_max)
    if engine is not None:
        used = "; ".join(f"{k}: {v}" for k, v in engine.sources().items())
        notes.append(f"decode step from {hardware.name}'s measured engine profile ({used})")
        notes.append(_engine_step_note(engine, w.mean_decode_context))
    latency = _latency(cost, w, b_max, hardware.bandwidth_bytes_per_s)
    if parallel is not None and parallel.core_message_s:
        latency = _remote_core(latency, parallel.core_message_s)
        notes.append(
            f"engine cores on other hosts: TTFT and E2E + 2 x {parallel.core_message_s * 1e3:.3f} "
            "ms (the request's message in, its first delta out); TPOT unchanged (the core does "
            "not wait for the client between steps)"
        )
    load = money = little = None
    if b_max:
        ttft_s = latency.ttft_cached_s if w.shared_prefix_tokens else latency.ttft_cold_s
        load, money, little = _economics(cost, w, a, prices, hardware, b_max, ttft_s, parallel)
        if not little.stable:
            notes.append(
                "Little's law: with M/M/1 queueing the stated volume keeps more requests per "
                "device in the system than fit; add devices or shorten requests"
            )
    return PlanResult(
        model=model,
        hardware=hardware,
        weight_format=fmt.name,
        kv_dtype=kv_dtype,
        workload=w,
        assumptions=a,
        prices=prices,
        num_params=model.num_params,
        num_matmul_params=model.num_matmul_params,
        weight_bytes=weight_bytes,
        bits_per_weight=fmt.bits_per_weight(model),
        formats=format_rows(model, fmt),
        kv_bytes_per_value=b,
        kv_bytes_per_token=k,
        kv_bytes_per_request=kv_request,
        bandwidth_bytes_per_s=bw,
        free_cache_bytes=free,
        max_concurrent=b_max,
        max_concurrent_shared_prefix=arith.max_concurrent_shared_prefix(
            free, k, w.tokens_per_request, w.shared_prefix_tokens
        ),
        latency=latency,
        intensity=_intensity(cost, fmt, w, b_max, hardware.ridge_flops_per_byte, b),
        load=load,
        cost=money,
        little=little,
        notes=tuple(notes),
        parallel=(
            None
            if parallel is None
            else parallel_plan(model, fmt, b, parallel, cost, w, b_max, latency, load)
        ),
    )
