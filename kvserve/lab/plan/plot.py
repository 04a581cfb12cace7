"""Roofline plot: a hardware profile's roof, the plan's phases on it, measured kernels under it."""

from __future__ import annotations

from pathlib import Path

from kvserve.lab.plan import arith
from kvserve.lab.plan.hardware import HardwareProfile
from kvserve.lab.plan.planner import PlanResult
from kvserve.lab.plan.report import fmt_bw, fmt_flops


def phase_points(plan: PlanResult) -> list[tuple[str, float, float]]:
    """(label, FLOP/byte, predicted FLOP/s) of prefill, decode alone and decode at the max batch."""
    m, w, lat, i = plan.model, plan.workload, plan.latency, plan.intensity
    t = w.mean_decode_context
    out = [
        (
            f"prefill {w.prompt_tokens} tok",
            i.prefill,
            arith.prefill_flops(m, w.prompt_tokens) / lat.ttft_cold_s,
        ),
        ("decode B=1", i.decode_solo, arith.decode_step_flops(m, 1, t) / lat.tpot_solo_s),
    ]
    if lat.tpot_max_batch_s is not None and i.decode_max_batch is not None:
        out.append(
            (
                f"decode B={plan.max_concurrent}",
                i.decode_max_batch,
                arith.decode_step_flops(m, plan.max_concurrent, t) / lat.tpot_max_batch_s,
            )
        )
    return out


def plot_roofline(
    path: str | Path, hardware: HardwareProfile, plan: PlanResult | None = None
) -> Path:
    """Write a log-log roofline (FLOP/s against FLOP/byte) to `path` (suffix picks the format).

    Long: one figure's roofs, points and labels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    peak, bw = hardware.peak_flops_per_s, hardware.bandwidth_bytes_per_s
    xs = [hardware.ridge_flops_per_byte]
    phases = phase_points(plan) if plan else []
    # the roofline's own kernels (engine points: linear:FMT, dispatch: are not on this plot)
    xs += [x for _, x, _ in phases] + [
        p.intensity_flops_per_byte for p in hardware.points if p.kind in ("gemv", "gemm")
    ]
    lo, hi = min(min(xs) / 4, 0.1), max(max(xs) * 4, 10 * hardware.ridge_flops_per_byte)
    grid = [lo * (hi / lo) ** (j / 200) for j in range(201)]

    fig = Figure(figsize=(8, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.loglog(
        grid,
        [min(peak, bw * x) for x in grid],
        "k-",
        lw=2,
        label=f"roof: {fmt_flops(peak)}, {fmt_bw(bw)}",
    )
    if plan and plan.assumptions.bandwidth_fraction != 1:
        bw_eff = plan.bandwidth_bytes_per_s
        ax.loglog(
            grid,
            [min(peak, bw_eff * x) for x in grid],
            "k--",
            lw=1,
            label=f"assumed achievable bandwidth ({plan.assumptions.bandwidth_fraction:g} x)",
        )
    ax.axvline(hardware.ridge_flops_per_byte, color="grey", ls=":", lw=1)
    ax.annotate(
        f"ridge {hardware.ridge_flops_per_byte:.3g}",
        (hardware.ridge_flops_per_byte, peak),
        textcoords="offset points",
        xytext=(4, -14),
        fontsize=8,
        color="grey",
    )
    for (label, x, y), marker in zip(phases, "o^s", strict=False):
        ax.loglog([x], [y], marker, ms=9, label=f"{label} (predicted)")
    gemm = [p for p in hardware.points if p.kind == "gemm"]
    gemv = [p for p in hardware.points if p.kind == "gemv"]
    if gemm:
        ax.loglog(
            [p.intensity_flops_per_byte for p in gemm],
            [p.flops_per_s for p in gemm],
            "x-",
            color="tab:red",
            label="measured GEMM (batch columns)",
        )
        for p in gemm:
            ax.annotate(
                str(p.num_columns),
                (p.intensity_flops_per_byte, p.flops_per_s),
                textcoords="offset points",
                xytext=(3, -10),
                fontsize=7,
                color="tab:red",
            )
    if gemv:
        ax.loglog(
            [p.intensity_flops_per_byte for p in gemv],
            [p.flops_per_s for p in gemv],
            "D",
            color="tab:purple",
            label="measured GEMV",
        )
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    title = hardware.name + (f": {plan.model.name}, {plan.weight_format}" if plan else "")
    ax.set_title(f"Roofline, {title} ({hardware.compute_dtype})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
