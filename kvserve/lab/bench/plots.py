"""Figures for the HTML report, as PNG bytes (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from kvserve.lab.bench.records import RequestRecord

_COLOURS = {
    "ok": "tab:blue",
    "failed": "tab:red",
    "rejected": "tab:orange",
    "timeout": "tab:purple",
    "cancelled": "tab:gray",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def cdf(series: dict[str, Sequence[float]], xlabel: str, title: str) -> bytes:
    """Empirical CDFs (seconds in, milliseconds on the axis), one line per series, log x when it
    helps."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, samples in series.items():
        x = np.sort(np.asarray(samples, dtype=float)) * 1e3
        if x.size:
            ax.step(
                x, np.arange(1, x.size + 1) / x.size, where="post", label=f"{label} (n={x.size})"
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _png(fig)


def histogram(samples: Sequence[float], xlabel: str, title: str) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    x = np.asarray(samples, dtype=float) * 1e3
    if x.size:
        ax.hist(x, bins=min(50, max(5, x.size // 4)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests")
    ax.set_title(f"{title} (n={x.size})")
    ax.grid(alpha=0.3)
    return _png(fig)


def timeline(records: Sequence[RequestRecord]) -> bytes:
    """One horizontal line per request from send to end; a dot at its first text chunk."""
    plt = _pyplot()
    sent = [r for r in records if r.t_send_s is not None and r.t_end_s is not None]
    fig, ax = plt.subplots(figsize=(7.2, max(2.5, min(8.0, 0.02 * len(sent) + 2))))
    for y, r in enumerate(sent):
        colour = "lightgray" if r.phase == "warmup" else _COLOURS[r.outcome]
        ax.hlines(y, r.t_send_s, r.t_end_s, colors=colour, linewidth=1)
        first = next((e.t_s for e in r.events if e.num_chars > 0), None)
        if first is not None:
            ax.plot([first], [y], ".", color="black", markersize=2)
    for outcome, colour in _COLOURS.items():
        ax.plot([], [], color=colour, label=outcome)
    ax.plot([], [], color="lightgray", label="warm-up")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("request (send order)")
    ax.set_title("request timeline (dot: first token)")
    ax.legend(fontsize=7, loc="upper left")
    return _png(fig)


def load_curve(rows: Sequence[dict]) -> bytes:
    """Latency percentiles and output throughput against offered load, for a sweep."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("latency_s") and np.isfinite(r["offered_rps"])]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10.0, 3.8))
    rates = [r["offered_rps"] for r in rows]
    for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("worst_gap", "worst gap")):
        for q, style in (("p50", "--"), ("p99", "-")):
            ys = [(r["latency_s"][key][q] or np.nan) * 1e3 for r in rows]
            ax1.plot(rates, ys, style, marker="o", label=f"{q} {label}")
    ax1.set_yscale("log")
    ax1.set_xlabel("offered load (requests/s)")
    ax1.set_ylabel("ms")
    ax1.set_title("latency vs offered load")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.plot(rates, [r["output_tokens_per_s"] or np.nan for r in rows], marker="o")
    ax2.set_xlabel("offered load (requests/s)")
    ax2.set_ylabel("output tokens/s")
    ax2.set_title("throughput vs offered load")
    ax2.grid(alpha=0.3)
    return _png(fig)
