"""benchmarks/plan_vs_measured.py's verdict per cell: measured / plan, the bound the plan names,
and in words the cause of a step that is not memory-bound and of a gap over the tolerance, with
the evidence (the plan's terms, the model's forward timed alone)."""

from __future__ import annotations

from kvserve.lab.bench.phases import MIN_FULL_BATCH_STEPS

TOLERANCE = 0.15


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def why_not_memory(row: dict) -> str | None:
    """What the plan says the step is besides streaming bytes at the GEMV bandwidth."""
    t = row.get("terms_s")
    if not t or row["bound"] == "memory":
        return None
    if row["bound"] == "compute":
        return "compute-bound: the FLOPs at the measured GEMM peak set the step"
    streaming = t["weights"] + t["kv"]
    if row["bound"] == "dispatch":
        return (
            f"dispatch overhead: host cost {_ms(t['dispatch'])} of the plan's "
            f"{_ms(row['plan_s'])} ({row.get('path', '?')} path)"
        )
    if row["bound"] == "engine":
        return (
            f"engine overhead: the engine outside the forward {_ms(t['engine'])} of the plan's "
            f"{_ms(row['plan_s'])} (sampler, runner, scheduler)"
        )
    return (
        f"kernel efficiency: the measured kernels stream the weights and cache in "
        f"{_ms(streaming)} where the bytes need {_ms(t['bandwidth'])} at the GEMV bandwidth "
        f"(weights {_ms(t['weights'])}, cache {_ms(t['kv'])})"
    )


def why_missed(row: dict) -> str:
    """The cause of a gap over the tolerance, from the forward timed alone when there is one."""
    t = row.get("terms_s", {})
    plan_forward = t.get("weights", 0) + t.get("kv", 0) + t.get("dispatch", 0)
    forward = row.get("forward_s")
    if not forward or not plan_forward:
        return "unexplained (the forward was not timed alone)"
    outside = row["measured_s"] - forward
    if abs(forward / plan_forward - 1) <= TOLERANCE:
        planned = t.get("engine", 0.0)
        rest = (
            ": the rest is the model's forward taking longer inside bench latency's steps than "
            "timed alone right after them, not the engine's own work"
            if planned and outside > 2 * planned
            else ""
        )
        return (
            f"engine host work outside the forward: {_ms(outside)} measured (the step less the "
            f"forward timed alone) against the plan's {_ms(planned)} (scheduler, sampler, "
            f"runner, timed inside the profile's engine steps){rest}"
        )
    if forward > plan_forward:
        where = "the cache read at long context or " if row["context"] > 1000 else ""
        return (
            f"the model's forward takes {_ms(forward)}, the plan's measured kernels "
            f"{_ms(plan_forward)} ({where}the model's matrices run slower than measured alone)"
        )
    return (
        f"the plan's kernels ({_ms(plan_forward)}) run slower than the model's forward "
        f"({_ms(forward)}): the measured points are slower than the model's own run"
    )


def machine_drift(row: dict) -> str | None:
    """When the GEMV probe around the row's steps ran at another speed than around the profile,
    and the ratio at the profile's speed (measured x speed: a faster machine shortens the step)
    is within the tolerance, the drift explains the gap; it is said, not corrected."""
    speed = row.get("gemv_speed_vs_profile")
    if not speed or abs(speed - 1) <= 0.05:
        return None
    at_profile = row["measured_over_plan"] * speed
    row["measured_over_plan_at_profile_speed"] = at_profile
    verdict = "within" if abs(at_profile - 1) <= TOLERANCE else "still outside"
    return (
        f"machine drift: the GEMV probe ran {speed:.2f}x the profile's speed around these steps "
        f"(measured / plan at the profile's speed ~ {at_profile:.2f}, {verdict} 15%)"
    )


def retimed(row: dict) -> str | None:
    """The same plan with its pooled layers and head timed again beside the steps
    (plan_vs_measured.retimed_profile): what is left of the gap at one machine speed."""
    if not row.get("plan_now_s"):
        return None
    ratio = row["measured_s"] / row["plan_now_s"]
    row["measured_over_plan_now"] = ratio
    verdict = "within" if abs(ratio - 1) <= TOLERANCE else "still outside"
    return (
        f"with the plan's pooled layers and head timed again beside these steps: measured / plan "
        f"{ratio:.2f} ({verdict} 15%)"
    )


def explain(rows: list[dict]) -> None:
    """Ratios to the roofline and to the measured engine profile's plan, and the cause."""
    for r in rows:
        r["measured_over_roofline"] = r["measured_s"] / r["roofline_s"]
        r["measured_over_plan"] = r["measured_s"] / r["plan_s"]
        t = r.get("terms_s", {})
        plan_forward = t.get("weights", 0) + t.get("kv", 0) + t.get("dispatch", 0)
        if r.get("forward_s"):
            r["outside_forward_s"] = r["measured_s"] - r["forward_s"]
            r["forward_over_plan_forward"] = r["forward_s"] / plan_forward if plan_forward else None
        within = abs(r["measured_over_plan"] - 1) <= TOLERANCE
        causes = [] if within else [why_missed(r)]
        if not within and (drifted := machine_drift(r)) is not None:
            causes.append(drifted)
        if (now := retimed(r)) is not None and not within:
            causes.append(now)
        if (other := why_not_memory(r)) is not None:
            causes.insert(0, other)
        full, total = r.get("full_batch_steps"), r.get("decode_steps")
        if full is not None and total and full < min(MIN_FULL_BATCH_STEPS, total):
            causes.append(
                f"only {full} of {total} decode steps carried all {r['batch']} rows: the measured "
                "median is over every decode step, some with fewer rows (the first requests "
                "decoded while later prompts filled, and finished first)"
            )
        r["within_tolerance"] = within
        r["cause"] = "; ".join(causes) if causes else "memory-bound, within 15%"


def print_table(rows: list[dict]) -> None:
    """A markdown table: one row per (format, batch, context)."""
    print(
        "| weights | batch | context | path | roofline | plan | bound | measured | forward "
        "| m/roofline | m/plan | m/plan now | cause |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fwd = _ms(r["forward_s"]) if r.get("forward_s") else "-"
        now = f"{r['measured_over_plan_now']:.2f}" if r.get("measured_over_plan_now") else "-"
        print(
            f"| {r['weights']} | {r['batch']} | {r['context']:.0f} | {r.get('path', '-')} "
            f"| {_ms(r['roofline_s'])} | {_ms(r['plan_s'])} | {r['bound']} "
            f"| {_ms(r['measured_s'])} | {fwd} | {r['measured_over_roofline']:.2f} "
            f"| {r['measured_over_plan']:.2f} | {now} | {r['cause']} |"
        )
