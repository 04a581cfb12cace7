"""`bench latency` output: the console table and the figure (matplotlib Agg, imported lazily)."""

from __future__ import annotations

from kvserve.lab.bench.phases import OVERHEAD_RATIO
from kvserve.lab.bench.plots import _png, _pyplot


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _bound(point: dict, phase: str) -> str:
    """`bandwidth x12` = bandwidth-bound by the roofline, measured 12 times the roofline time."""
    name = point["bottleneck"][phase].removesuffix("-bound")
    rf = point.get("roofline")
    if rf is None:
        return name
    ratio = rf["prefill" if phase == "prefill" else "decode_step"]["measured_over_roofline"]
    return name if ratio is None else f"{name} x{ratio:.3g}"


def point_line(pt: dict) -> str:
    pre, dec = pt["prefill"], pt["decode"]
    return (
        f"B={pt['batch_size']} P={pt['prompt_len']} O={pt['output_len']}: prefill "
        f"{_ms(pre['batch_prefill_s']['p50'])} ms, decode step p50 {_ms(dec['step_s']['p50'])} ms "
        f"(n={dec['step_s']['count']})"
    )


COLUMNS = (
    # header, width, cell(point)
    ("B", 4, lambda p: str(p["batch_size"])),
    ("P", 6, lambda p: str(p["prompt_len"])),
    ("O", 5, lambda p: str(p["output_len"])),
    ("prefill ms", 12, lambda p: _ms(p["prefill"]["batch_prefill_s"]["p50"])),
    ("prompt tok/s", 13, lambda p: _num(p["prefill"]["prompt_tokens_per_s"], ".0f")),
    ("step p50", 10, lambda p: _ms(p["decode"]["step_s"]["p50"])),
    ("p90", 8, lambda p: _ms(p["decode"]["step_s"]["p90"])),
    ("p99", 8, lambda p: _ms(p["decode"]["step_s"]["p99"])),
    ("max", 8, lambda p: _ms(p["decode"]["step_s"]["max"])),
    ("n", 5, lambda p: str(p["decode"]["step_s"]["count"])),
    # the step at the batch's rows (full-batch steps' p50, `batch_step_s`) and how many there were
    ("B-row step", 11, lambda p: _ms(p["decode"].get("batch_step_s"))),
    ("full", 5, lambda p: str(p["decode"].get("num_full_batch_steps", "-"))),
    ("tok/s/seq", 10, lambda p: _num(p["decode"]["per_sequence_tokens_per_s"])),
    ("tok/s agg", 10, lambda p: _num(p["decode"]["aggregate_tokens_per_s"])),
    ("wall s", 8, lambda p: _num(p["wall"]["iteration_s"]["p50"], ".3f")),
    ("prefill%", 9, lambda p: _num(p["wall"]["prefill_share"], ".0%")),
    ("decode%", 8, lambda p: _num(p["wall"]["decode_share"], ".0%")),
    ("prefill bound", 17, lambda p: _bound(p, "prefill")),
    ("decode bound", 17, lambda p: _bound(p, "decode")),
    ("same", 6, lambda p: "yes" if not p["identical"]["num_mismatches"] else "NO"),
)


def table(doc: dict) -> str:
    eng, grid = doc["engine"], doc["grid"]
    lines = [
        f"model {doc['model']['dir']} ({eng['dtype']}, {eng['device']}"
        f"{', ' + eng['device_name'] if eng['device_name'] else ''}, {eng['torch_threads']} "
        f"threads); {grid['num_iters']} timed iterations per point after "
        f"{grid['num_warmup_iters']} warm-up; forced length, greedy",
        "prefill = batch prefill wall (TTFT proxy, p50 over iterations); step = decode step "
        "times (ms, pooled over iterations); B-row step = the p50 of the steps where all B rows "
        "decoded (with 3 or more of them, else of all), which tok/s and x use; "
        "x = measured / roofline",
        "".join(f"{h:>{w}}" for h, w, _ in COLUMNS),
    ]
    lines += ["".join(f"{cell(p):>{w}}" for _, w, cell in COLUMNS) for p in doc["points"]]
    ident = doc["identical_outputs"]
    lines.append(
        f"identical outputs (alone vs batched): {ident['num_compared'] - ident['num_mismatches']}"
        f"/{ident['num_compared']}; run-to-run mismatches: {ident['num_repeat_mismatches']}"
    )
    for m in ident["mismatches"][:10]:
        gap = "-" if m["top_two_gap"] is None else f"{m['top_two_gap']:.3g}"
        lines.append(
            f"  MISMATCH B={m['batch_size']} P={m['prompt_len']} O={m['output_len']} prompt "
            f"{m['prompt_index']}: first differs at position {m['position']} (alone "
            f"{m['reference_token']}, batched {m['token']}; top-two gap alone {gap})"
        )
    ratios = [
        r
        for p in doc["points"]
        if p.get("roofline")
        for k in ("prefill", "decode_step")
        if (r := p["roofline"][k]["measured_over_roofline"]) is not None
    ]
    if any(r > OVERHEAD_RATIO for r in ratios):
        lines.append(
            f"x > {OVERHEAD_RATIO:g}: per-step fixed costs dominate there, not the named bound"
        )
    if any(r < 1 for r in ratios):
        lines.append(
            "x < 1: faster than the roofline: the profile understates the device, or the formula "
            "counts work the engine skips (the LM head on every prompt token); see bottleneck.note"
        )
    hw = doc["hardware_profile"]
    lines.append(
        "roofline: "
        + (f"{hw['name']} ({doc['hardware_profile_source']})" if hw else "unknown: ")
        + ("" if hw else doc["hardware_profile_source"])
    )
    return "\n".join(lines)


def plot(doc: dict) -> bytes:
    """Four panels: batch prefill time vs prompt tokens; decode step time (p50, whiskers to p99,
    roofline dashed) and aggregate decode tokens/s vs batch size; the wall clock of one iteration
    split into prefill, decode and the rest.

    Long: four panels drawn one after another on shared axes."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    points = doc["points"]
    fig, axes = plt.subplots(2, 2, figsize=(11.0, 7.6))
    (ax_pre, ax_step), (ax_tput, ax_wall) = axes
    for b in doc["grid"]["batch_sizes"]:
        pts = sorted((p for p in points if p["batch_size"] == b), key=lambda p: p["prompt_len"])
        xs = [p["batch_size"] * p["prompt_len"] for p in pts]
        ax_pre.plot(
            xs,
            [_ms_f(p["prefill"]["batch_prefill_s"]["p50"]) for p in pts],
            "o-",
            label=f"batch {b}",
        )
    ax_pre.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens in the batch (B x P)",
        ylabel="ms",
        title="prefill of the batch (TTFT proxy)",
    )
    for p_len in doc["grid"]["prompt_lens"]:
        for o_len in doc["grid"]["output_lens"]:
            pts = sorted(
                (p for p in points if (p["prompt_len"], p["output_len"]) == (p_len, o_len)),
                key=lambda p: p["batch_size"],
            )
            if not pts or not pts[0]["decode"]["step_s"]["count"]:
                continue
            bs = [p["batch_size"] for p in pts]
            p50 = [_ms_f(p["decode"]["step_s"]["p50"]) for p in pts]
            p99 = [_ms_f(p["decode"]["step_s"]["p99"]) for p in pts]
            lo = [_ms_f(p["decode"]["step_s"]["min"]) for p in pts]
            err = [
                [a - b for a, b in zip(p50, lo, strict=True)],
                [b - a for a, b in zip(p50, p99, strict=True)],
            ]
            line = ax_step.errorbar(
                bs, p50, yerr=err, fmt="o-", capsize=3, label=f"P={p_len} O={o_len}"
            )
            if all(p.get("roofline") for p in pts):
                roof = [p["roofline"]["decode_step"]["roofline_s"] * 1e3 for p in pts]
                ax_step.plot(bs, roof, "--", color=line[0].get_color(), alpha=0.6)
            ax_tput.plot(
                bs,
                [p["decode"]["aggregate_tokens_per_s"] for p in pts],
                "o-",
                label=f"P={p_len} O={o_len}",
            )
    ax_step.set(
        xscale="log",
        yscale="log",
        xlabel="batch size",
        ylabel="ms",
        title="decode step time (p50, min..p99; dashed: roofline)",
    )
    ax_tput.set(
        xscale="log",
        xlabel="batch size",
        ylabel="output tokens/s (all sequences)",
        title="decode throughput (B / p50 step)",
    )
    labels = [f"{p['batch_size']}/{p['prompt_len']}/{p['output_len']}" for p in points]
    pre = [_ms_f(p["wall"]["prefill_s"]) for p in points]
    dec = [_ms_f(p["wall"]["decode_s"]) for p in points]
    other = [max(0.0, _ms_f(p["wall"]["other_s"])) for p in points]
    xs = range(len(points))
    ax_wall.bar(xs, pre, label="prefill")
    ax_wall.bar(xs, dec, bottom=pre, label="decode steps")
    ax_wall.bar(xs, other, bottom=[a + b for a, b in zip(pre, dec, strict=True)], label="other")
    ax_wall.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=7)
    ax_wall.set(ylabel="ms", xlabel="B/P/O", title="one iteration's wall clock (p50s)")
    for ax in (ax_step, ax_tput):  # plain batch-size ticks on the log axis
        ax.set_xticks(doc["grid"]["batch_sizes"], [str(b) for b in doc["grid"]["batch_sizes"]])
        ax.xaxis.set_minor_locator(NullLocator())
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(
        f"kvserve bench latency: {doc['model']['dir']} ({doc['engine']['device']})", fontsize=9
    )
    fig.tight_layout()
    return _png(fig)


def _ms_f(x: float | None) -> float:
    return float("nan") if x is None else x * 1e3
