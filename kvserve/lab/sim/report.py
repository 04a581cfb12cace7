"""Text tables of simulated runs and capacity searches, and the p99 TTFT / ITL vs rate plot."""

from __future__ import annotations

import math
from pathlib import Path

from kvserve.lab.sim.study import brief


def _s(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value >= 100:
        return f"{value:.0f}s"
    if value >= 1:
        return f"{value:.2f}s"
    return f"{value * 1e3:.1f}ms"


def _n(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}"


COLUMNS = (
    ("policy", 18, lambda b: b["policy"]),
    ("rate", 6, lambda b: _n(b["nominal_rate_rps"])),
    ("real", 6, lambda b: _n(b["realised_rate_rps"])),
    ("TTFT p50", 9, lambda b: _s(b["ttft_p50_s"])),
    ("p99", 8, lambda b: _s(b["ttft_p99_s"])),
    ("ITL p50", 8, lambda b: _s(b["itl_p50_s"])),
    ("p99", 8, lambda b: _s(b["itl_p99_s"])),
    ("max", 8, lambda b: _s(b["itl_max_s"])),
    ("gap p50", 8, lambda b: _s(b["worst_gap_p50_s"])),
    ("p99", 8, lambda b: _s(b["worst_gap_p99_s"])),
    ("E2E p50", 8, lambda b: _s(b["e2e_p50_s"])),
    ("p99", 8, lambda b: _s(b["e2e_p99_s"])),
    ("tok/s", 8, lambda b: _n(b["output_tokens_per_s"], 4)),
    ("req/s", 6, lambda b: _n(b["requests_per_s"])),
    ("good/s", 7, lambda b: " ".join(_n(g) for g in b["goodput_rps"]) or "-"),
    ("preempt", 7, lambda b: str(b["num_preemptions"])),
    ("fail", 4, lambda b: str(b["num_failed"] or 0)),
    ("$/Mtok", 7, lambda b: _n(b["usd_per_million_output"])),
)


def render_runs(results: list[dict]) -> str:
    head = " ".join(f"{name:>{w}}" for name, w, _ in COLUMNS)
    lines = [head]
    for result in results:
        b = brief(result)
        lines.append(" ".join(f"{fn(b):>{w}}" for _, w, fn in COLUMNS))
    return "\n".join(lines) + "\n"


def render_rejections(results: list[dict]) -> str:
    """One line per run with rejected requests: how many, and why (kvserve.lab.sim.timeline's kinds)."""
    lines = []
    for result in results:
        rejections = result["sim"].get("rejections") or {}
        if not rejections:
            continue
        rate = result["nominal_rate_rps"]
        where = f"{result['policy']} at {'trace' if rate is None else _n(rate)} req/s"
        for kind, entry in rejections.items():
            lines.append(
                f"rejected {entry['count']} request(s) ({where}): {kind.replace('_', ' ')}; "
                f"e.g. {entry['example_request']}: {entry['example']}"
            )
    return "\n".join(lines) + "\n" if lines else ""


def render_capacity(searches: list[dict]) -> str:
    lines = []
    for s in searches:
        cap = s["capacity_rps"]
        text = "none of the tested rates passed" if cap is None else f"{cap:.3g} req/s"
        if s.get("lower_bound_only"):
            text += " (lower bound: no tested rate failed)"
        line = f"{s['policy']:>18}: capacity {text}"
        at = s.get("at_capacity")
        if at:
            line += (
                f"; there TTFT p99 {_s(at['ttft_p99_s'])}, ITL p99 {_s(at['itl_p99_s'])}, "
                f"{_n(at['output_tokens_per_s'], 4)} tok/s"
            )
            if at["usd_per_million_output"] is not None:
                line += f", ${at['usd_per_million_output']:.3g} per M output tokens"
        if s.get("non_monotonic_rates"):
            line += f" (non-monotonic at {s['non_monotonic_rates']})"
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot_rates(path: str | Path, results: list[dict], title: str = "") -> Path:
    """p99 TTFT and p99 ITL against the nominal rate, one line per policy (finite rates only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    by_policy: dict[str, list[dict]] = {}
    for result in results:
        by_policy.setdefault(result["policy"], []).append(brief(result))
    for ax, key, label in (
        (axes[0], "ttft_p99_s", "p99 TTFT (s)"),
        (axes[1], "itl_p99_s", "p99 ITL (s)"),
    ):
        for i, (policy, rows) in enumerate(by_policy.items()):
            pts = sorted(
                (r["nominal_rate_rps"], r[key])
                for r in rows
                if r["nominal_rate_rps"] is not None
                and math.isfinite(r["nominal_rate_rps"])
                and r[key] is not None
            )
            if pts:
                # Distinct markers and dashes: policies that behave alike draw on top of each other.
                style = {"marker": "osD^v"[i % 5], "linestyle": ("-", "--", ":", "-.")[i % 4]}
                ax.plot(*zip(*pts, strict=True), label=policy, **style)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
