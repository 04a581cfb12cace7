"""Offline phase-split timing (docs/load-tests.md), the pure part: no torch, no engine.

`kvserve bench latency` times every engine step of a batch and hands the samples here:

- the prefill phase runs from the first step to the step in which the last request of the batch got
  its first token (a chunked prompt spans several steps; a step that also decodes requests whose
  prompt is done is counted as "mixed"). Its duration is the batch's TTFT proxy: prefill forward(s)
  plus the first sample.
- the decode phase is every later step; each one samples one token per running sequence. Its step
  times are kept as a distribution, never folded together with the prefill into one tokens/s.

Also here: the identical-output check (first differing position and the reference's top-two gap
there) and the roofline bottleneck of a regime from kvserve.lab.plan's arithmetic.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.lab.bench.metrics import Percentiles
from kvserve.lab.bench.records import BenchError
from kvserve.lab.plan import arith
from kvserve.lab.plan.formats import KVFormat, parse_weight_format
from kvserve.lab.plan.hardware import (
    HardwareProfile,
    default_profile_path,
    get_profile,
    load_profile_file,
)
from kvserve.lab.plan.model import ModelSpec, PlanError
from kvserve.lab.plan.planner import Assumptions

BOUND_NAMES = {"memory": "bandwidth-bound", "compute": "compute-bound"}
# Measured time over roofline time above which per-step fixed costs (Python, kernel launches),
# not the device's bandwidth or FLOP/s, set the time.
OVERHEAD_RATIO = 10.0


# the decode step at a batch's rows is the median of the steps where every request decoded when
# there are at least this many of them, else of every decode step
MIN_FULL_BATCH_STEPS = 3


@dataclass(frozen=True)
class StepSample:
    """One timed engine step: wall seconds (synchronised), and what it produced."""

    duration_s: float
    num_first_tokens: int  # requests that got their first token in this step
    num_decode_tokens: int  # tokens for requests that already had their first one
    # those requests that got a token this step (rows decoding; with speculative decoding a row
    # may get several tokens); None: as many as num_decode_tokens
    num_decode_rows: int | None = None

    @property
    def decode_rows(self) -> int:
        return self.num_decode_tokens if self.num_decode_rows is None else self.num_decode_rows


@dataclass(frozen=True)
class PhaseSplit:
    prefill_s: float | None  # None: some request never got a first token
    num_prefill_steps: int
    num_mixed_steps: int  # prefill-phase steps that also decoded finished prompts
    decode_step_s: tuple[float, ...]
    num_idle_steps: int  # decode-phase steps with no token (e.g. recompute after preemption)
    idle_s: float
    # the requests each decode step decoded: with chunked prefill the first requests decode while
    # later prompts fill, so they finish first and the decode phase's later steps carry fewer rows
    # than the batch
    decode_step_rows: tuple[int, ...] = ()

    @property
    def decode_s(self) -> float:
        return sum(self.decode_step_s)


def split_phases(steps: Sequence[StepSample], num_requests: int) -> PhaseSplit:
    """Prefill phase = steps up to the one giving the last request its first token; decode = the
    rest."""
    seen = 0
    end = None
    for i, step in enumerate(steps):
        seen += step.num_first_tokens
        if seen >= num_requests:
            end = i + 1
            break
    if end is None:
        return PhaseSplit(None, len(steps), 0, (), 0, 0.0)
    prefill = steps[:end]
    decode = [s for s in steps[end:] if s.num_decode_tokens > 0]
    idle = [s for s in steps[end:] if s.num_decode_tokens == 0]
    return PhaseSplit(
        prefill_s=sum(s.duration_s for s in prefill),
        num_prefill_steps=len(prefill),
        num_mixed_steps=sum(s.num_decode_tokens > 0 for s in prefill),
        decode_step_s=tuple(s.duration_s for s in decode),
        num_idle_steps=len(idle),
        idle_s=sum(s.duration_s for s in idle),
        decode_step_rows=tuple(s.decode_rows for s in decode),
    )


@dataclass(frozen=True)
class Iteration:
    """One timed generation of a batch: its steps, the engine's per-request timestamps, outputs."""

    split: PhaseSplit
    wall_s: float  # first step start -> last step end, loop overhead included
    ttft_proxy_s: tuple[float, ...]  # per request: engine first_token - first_scheduled
    itl_engine_s: tuple[float, ...]  # per request gaps of the engine's token timestamps, pooled
    output_token_ids: tuple[tuple[int, ...], ...]
    num_preemptions: int


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def point_summary(
    batch_size: int, prompt_len: int, output_len: int, iterations: Sequence[Iteration]
) -> dict:
    """One grid point over its timed iterations: prefill and decode side by side, never blended."""
    prefill = [it.split.prefill_s for it in iterations if it.split.prefill_s is not None]
    steps = [s for it in iterations for s in it.split.decode_step_s]
    full = [  # the decode steps with every request of the batch decoding
        s
        for it in iterations
        for s, n in zip(it.split.decode_step_s, it.split.decode_step_rows, strict=False)
        if n == batch_size
    ]
    decode_totals = [it.split.decode_s for it in iterations]
    walls = [it.wall_s for it in iterations]
    prefill_med, step_med, wall_med = _median(prefill), _median(steps), _median(walls)
    # the step at the batch's rows: the full-batch median where there are enough such steps
    batch_step = _median(full) if len(full) >= MIN_FULL_BATCH_STEPS else step_med
    decode_med = _median(decode_totals)
    other = None
    if None not in (prefill_med, decode_med, wall_med):
        other = wall_med - prefill_med - decode_med
    num_tokens = batch_size * prompt_len
    return {
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "num_iterations": len(iterations),
        "prefill": {
            "batch_prefill_s": Percentiles.of(prefill).to_json(),
            "prompt_tokens_per_s": num_tokens / prefill_med if prefill_med else None,
            "num_steps": [it.split.num_prefill_steps for it in iterations],
            "num_mixed_steps": [it.split.num_mixed_steps for it in iterations],
            "ttft_proxy_s": Percentiles.of(
                t for it in iterations for t in it.ttft_proxy_s
            ).to_json(),
        },
        "decode": {
            "step_s": Percentiles.of(steps).to_json(),
            # the step at the batch's rows: the later decode steps of a batch whose prompts
            # were chunked carry fewer (their requests finished first)
            "full_batch_step_s": Percentiles.of(full).to_json(),
            "num_full_batch_steps": len(full),
            # the step at the batch's rows (the tokens/s and the roofline's measured step): the
            # full-batch p50 with at least MIN_FULL_BATCH_STEPS of them, else the p50 of all
            "batch_step_s": batch_step,
            "num_steps_per_iteration": [len(it.split.decode_step_s) for it in iterations],
            "per_sequence_tokens_per_s": 1.0 / batch_step if batch_step else None,
            "aggregate_tokens_per_s": batch_size / batch_step if batch_step else None,
            "itl_engine_s": Percentiles.of(
                g for it in iterations for g in it.itl_engine_s
            ).to_json(),
            "num_idle_steps": [it.split.num_idle_steps for it in iterations],
        },
        "wall": {
            "iteration_s": Percentiles.of(walls).to_json(),
            "prefill_s": prefill_med,
            "decode_s": decode_med,
            "other_s": other,
            "prefill_share": prefill_med / wall_med if prefill_med and wall_med else None,
            "decode_share": decode_med / wall_med if decode_med is not None and wall_med else None,
        },
        "num_preemptions": sum(it.num_preemptions for it in iterations),
    }


# --- identical outputs --------------------------------------------------------------------------------


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other);
    None when equal."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def mismatch(
    reference: Sequence[int],
    other: Sequence[int],
    top_two: Sequence[tuple[tuple[int, float], ...]] | None = None,
) -> dict | None:
    """None when equal; else the first differing position, both tokens there, and the reference's
    top-two logprob gap there (= the logit gap) when `top_two` (per-position alternatives) has it:
    a tiny gap says the batch shape's rounding flipped a near tie."""
    pos = first_difference(reference, other)
    if pos is None:
        return None
    gap = None
    if top_two is not None and pos < len(top_two) and len(top_two[pos]) >= 2:
        gap = top_two[pos][0][1] - top_two[pos][1][1]
    return {
        "position": pos,
        "reference_token": reference[pos] if pos < len(reference) else None,
        "token": other[pos] if pos < len(other) else None,
        "top_two_gap": gap,
    }


# --- roofline -----------------------------------------------------------------------------------------

_DTYPE_FORMATS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_DEVICE_RE = re.compile(r"\((cpu|cuda|mps|xpu)\b")


def profile_device(profile: HardwareProfile) -> str | None:
    """The device family a measured profile was taken on (from its source line), if it says."""
    m = _DEVICE_RE.search(profile.source)
    return m.group(1) if m else None


def regime(
    model: ModelSpec,
    profile: HardwareProfile,
    dtype: str,
    batch_size: int,
    prompt_len: int,
    output_len: int,
    bandwidth_fraction: float = 1.0,
) -> dict:
    """Roofline of one grid point (docs/planning.md): the prefill of B prompts and a decode step of B
    sequences at the mean decode context, each named compute- or bandwidth-bound."""
    fmt = _DTYPE_FORMATS[dtype]
    weight_bytes = parse_weight_format(fmt).weight_bytes(model)
    kv = arith.kv_bytes_per_token(model, KVFormat(fmt).bytes_per_value(model.head_dim))
    bw = profile.bandwidth_bytes_per_s * bandwidth_fraction
    peak = profile.peak_flops_per_s
    # prefill: every prompt computed together, the weights read once, the new KV written
    p_flops = batch_size * arith.prefill_flops(model, prompt_len)
    p_bytes = weight_bytes + kv * batch_size * prompt_len
    t = prompt_len + output_len / 2  # the k-th output token attends to prompt + k
    d_flops = arith.decode_step_flops(model, batch_size, t)
    d_bytes = arith.decode_step_bytes(weight_bytes, kv, batch_size, t)

    def phase(flops: float, num_bytes: float) -> dict:
        compute_s, memory_s = flops / peak, num_bytes / bw
        return {
            "flops": flops,
            "bytes": num_bytes,
            "intensity_flops_per_byte": flops / num_bytes,
            "roofline_s": max(compute_s, memory_s),
            "bound": BOUND_NAMES["compute" if compute_s > memory_s else "memory"],
        }

    return {
        "ridge_flops_per_byte": peak / bw,
        "mean_decode_context": t,
        "prefill": phase(p_flops, p_bytes),
        "decode_step": phase(d_flops, d_bytes),
    }


def attach_measured(roofline: dict, prefill_s: float | None, decode_step_s: float | None) -> dict:
    """Add the measured times and how far they sit above the roofline; a ratio above
    OVERHEAD_RATIO says per-step fixed costs, not the named bound, dominate."""
    for key, measured in (("prefill", prefill_s), ("decode_step", decode_step_s)):
        phase = roofline[key]
        phase["measured_s"] = measured
        ratio = measured / phase["roofline_s"] if measured and phase["roofline_s"] > 0 else None
        phase["measured_over_roofline"] = ratio
        phase["overhead_dominated"] = ratio is not None and ratio > OVERHEAD_RATIO
    return roofline


def bottleneck(roofline: dict) -> dict:
    """The bound of each phase, with notes when the measurement sits far above the roofline time
    (fixed costs dominate) or below it (the roofline's inputs overstate the work or understate
    the device)."""
    out = {"prefill": roofline["prefill"]["bound"], "decode": roofline["decode_step"]["bound"]}
    ratios = {k: roofline[k].get("measured_over_roofline") for k in ("prefill", "decode_step")}
    notes = []
    slow = [k for k, r in ratios.items() if r is not None and r > OVERHEAD_RATIO]
    if slow:
        notes.append(
            f"{' and '.join(slow)} measured over {OVERHEAD_RATIO:g}x the roofline time: per-step "
            "fixed costs (Python, kernel launches, a small model) dominate; the named bound is "
            "the one the hardware would impose"
        )
    fast = [k for k, r in ratios.items() if r is not None and r < 1]
    if fast:
        notes.append(
            f"{' and '.join(fast)} measured faster than the roofline time: the profile understates "
            "this device (e.g. measured under load), or the formula counts work the engine skips "
            "(docs/planning.md's prefill FLOPs run the LM head on every prompt token; the engine "
            "computes logits only for the rows it samples)"
        )
    if notes:
        out["note"] = "; ".join(notes)
    return out


def resolve_hardware(name: str, device: str) -> tuple[HardwareProfile | None, str]:
    """(profile or None, why): `auto` uses the measured this-machine profile when it exists and was
    taken on this kind of device; `none` opts out; anything else names a profile."""
    if name == "none":
        return None, "--hardware none"
    if name != "auto":
        try:
            return get_profile(name), f"--hardware {name}"
        except PlanError as exc:
            raise BenchError(str(exc)) from exc
    path = default_profile_path()
    if not path.is_file():
        return None, f"no measured profile at {path} (run `kvserve plan --measure`) or --hardware"
    try:
        profile = load_profile_file(path)
    except PlanError as exc:
        return None, str(exc)
    measured_on = profile_device(profile)
    if measured_on is not None and measured_on != device.split(":")[0]:
        return None, (
            f"the measured profile at {path} is for {measured_on}, this run uses {device}: "
            f"measure this device (`kvserve plan --measure --device {device}`) or pass --hardware"
        )
    return profile, f"measured profile {path}"


def point_roofline(model: ModelSpec, profile: HardwareProfile, dtype: str, point: dict) -> dict:
    """`regime` of a summarised grid point with its measured p50 times attached. The bandwidth is
    the planner's: a measured profile's in full, 0.8 of a datasheet peak."""
    fraction = Assumptions().resolved(profile).bandwidth_fraction
    rf = regime(
        model,
        profile,
        dtype,
        point["batch_size"],
        point["prompt_len"],
        point["output_len"],
        fraction,
    )
    return attach_measured(
        rf, point["prefill"]["batch_prefill_s"]["p50"], point["decode"]["batch_step_s"]
    )
