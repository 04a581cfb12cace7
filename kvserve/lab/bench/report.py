"""Console table and self-contained HTML reports (plots embedded as base64 PNG)."""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Sequence
from pathlib import Path

from kvserve.lab.bench.metrics import request_metrics
from kvserve.lab.bench.records import RequestRecord

LATENCY_ROWS = (
    ("ttft", "TTFT"),
    ("tpot", "TPOT"),
    ("itl", "ITL (chunk)"),
    ("itl_token", "ITL (token)"),
    ("worst_gap", "worst gap/request"),
    ("e2e", "E2E"),
    ("queue_time", "queue time (server)"),
)


def _ms(x: float | str | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):  # summary.json writes a non-finite value as text ("inf", "nan")
        return x
    return f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):  # summary.json writes inf as "inf"
        return x
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


def headline(summary: dict) -> list[str]:
    """What was measured: target, mode, content, workload, arrivals, counts, window."""
    meta = summary.get("metadata", {})
    target, arr, wl = meta.get("target", {}), meta.get("arrivals", {}), meta.get("workload", {})
    acceptance = meta.get("server_counters", {}).get("speculative_acceptance_rate")
    lines = [
        f"target {target.get('base_url')} ({target.get('endpoint')}), model {target.get('model')}",
        f"mode {meta.get('mode')}, content {wl.get('content')}, speculative acceptance "
        f"{'not reported' if acceptance is None else f'{acceptance:.1%}'}",
        f"workload {wl.get('kind')} (in {wl.get('input_len', '-')}, "
        f"out {wl.get('output_len', '-')}), tokenizer {wl.get('tokenizer')}",
        f"arrivals: {arr.get('process')} ({arr.get('loop')} loop), seed {arr.get('seed')}",
    ]
    reset = meta.get("prefix_cache_reset")
    if reset is not None:
        lines.append(
            "prefix cache: reset before this run"
            if reset["status"] == "ok"
            else "prefix cache: not reset (--reset-prefix-cache not given)"
            if not reset["requested"]
            else f"prefix cache: reset FAILED ({reset['status']}: {reset['detail']})"
        )
    c = summary["counts"]
    lines.append(
        f"measured {c['measured']}: ok {c['ok']}, failed {c['failed']}, rejected {c['rejected']}, "
        f"timeout {c['timeout']}, cancelled {c['cancelled']}; warm-up {c['warmup']} excluded"
    )
    for failure in summary.get("failures_by_reason", [])[:5]:
        lines.append(f"  {failure['count']} x {failure['reason']}")
    clipped = wl.get("num_clipped_to_context")
    if clipped:
        lines.append(
            f"  {clipped} prompts clipped to fit the server's context of "
            f"{wl.get('server_max_model_len')} tokens"
        )
    w = summary.get("window")
    if w:
        lines.append(
            f"window {w['duration_s']:.2f} s (steady {w['steady_s']:.2f} s, "
            f"drain {w['drain_s']:.2f} s)"
        )
    return lines


def _latency_lines(summary: dict) -> list[str]:
    head = "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p99", "max"))
    lines = [f"{'metric (ms)':<22}{'count':>8}{head}"]
    for key, label in LATENCY_ROWS:
        p = summary["latency_s"][key]
        cells = "".join(f"{_ms(p[q]):>10}" for q in ("mean", "p50", "p90", "p99", "max"))
        lines.append(f"{label:<22}{p['count']:>8}{cells}")
    return lines


def _load_test_lines(summary: dict) -> list[str]:
    a, cl, wc = summary["arrivals"], summary["client"], summary["wall_clock"]
    lag, loop_lag = a["schedule_lag_s"], cl["event_loop_lag_s"]
    warn = "  WARNING: the load generator may be the bottleneck" if cl["bottleneck_warning"] else ""
    prefill = f"share {_num(wc['prefill_share'], '.0%')}"
    prefill += ", MOSTLY PREFILL" if wc["mostly_prefill"] else ""
    lines = [
        f"arrival rate: nominal {_num(a['nominal_rate_rps'])}/s, "
        f"realised {_num(a['realised_rate_rps'])}/s; schedule lag p50 {_ms(lag['p50'])} ms, "
        f"p99 {_ms(lag['p99'])} ms, max {_ms(lag['max'])} ms",
        f"client: event-loop lag p99 {_ms(loop_lag['p99'])} ms, max {_ms(loop_lag['max'])} ms, "
        f"CPU {_num(cl['cpu_fraction'], '.0%')}{warn}",
        f"wall clock: prefill ~{_num(wc['prefill_s'])} s of {_num(wc['wall_s'])} s ({prefill}); "
        f"longest output {wc['longest_output_tokens']} tok at "
        f"{_num(wc['per_request_decode_tok_s'], '.1f')} tok/s per request "
        f"~{_num(wc['decode_s'])} s",
    ]
    if wc.get("note"):
        lines.append(f"  note: {wc['note']}")
    ll = summary["littles_law"]
    if ll.get("ratio") is not None:
        verdict = {
            True: "holds",
            None: "nothing completed",
            False: f"DOES NOT HOLD: queue growing, or interval only "
            f"{ll['interval_over_time_in_system']:.1f}x the time in system",
        }
        lines.append(
            f"Little's law ({ll['interval']}): mean in system {ll['mean_in_system']:.2f} vs "
            f"completed rate x time {ll['rate_x_time']:.2f} (ratio {ll['ratio']:.2f}, "
            f"{verdict[ll['holds']]})"
        )
    tpc = summary["tokens_per_chunk"]
    lines.append(
        f"tokens per chunk: mean {_num(tpc['mean_tokens_per_chunk'])}, "
        f"histogram {tpc['histogram']} ({tpc['num_requests_with_per_chunk_counts']}/"
        f"{tpc['num_requests']} requests with per-chunk counts)"
    )
    return lines


def console_table(summary: dict) -> str:
    lines = headline(summary)
    if not summary.get("window"):
        return "\n".join(lines + ["no measured request was sent"])
    t = summary["throughput"]
    lines.append(
        f"throughput: {_num(t['requests_per_s'])} req/s, "
        f"{_num(t['output_tokens_per_s'], '.1f')} output tok/s "
        f"({t['total_output_tokens']} tokens); "
        f"input processed {_num(t['input_tokens_processed_per_s'], '.1f')} tok/s"
    )
    lines += _latency_lines(summary) + _goodput_lines(summary) + _load_test_lines(summary)
    return "\n".join(lines)


def _goodput_lines(summary: dict) -> list[str]:
    out = []
    for g in summary.get("goodput", []):
        if g["style"] == "per-request":
            att = _num(g["attainment"], ".1%")
            out.append(f"goodput [{g['name']}]: {_num(g['goodput_rps'])} req/s (attainment {att})")
        else:
            state = "met" if g["met"] else "NOT met"
            vals = ", ".join(f"{_ms(v['value_s'])} ms (n={v['num_samples']})" for v in g["values"])
            out.append(f"goodput [{g['name']}]: {_num(g['goodput_rps'])} req/s ({state}: {vals})")
    return out


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _page(title: str, body: list[str]) -> str:
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}pre{background:#f4f4f4;"
        "padding:1em;overflow-x:auto;font-size:12px}img{max-width:100%}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{''.join(body)}</body></html>"
    )


def write_run_html(
    path: Path, summary: dict, records: Sequence[RequestRecord], plots: bool = True
) -> None:
    body = [f"<pre>{html.escape(console_table(summary))}</pre>"]
    if plots and summary.get("window"):
        from kvserve.lab.bench import plots as p

        done = [m for r in records if r.phase == "measured" and (m := request_metrics(r))]
        body.append(_img(p.cdf({"TTFT": [m.ttft_s for m in done]}, "ms", "TTFT CDF"), "TTFT CDF"))
        itl = {
            "chunk-level": [g for m in done for g in m.itl_chunk_s],
            "token-level": [g for m in done if m.itl_token_s for g in m.itl_token_s],
        }
        body.append(_img(p.cdf(itl, "ms", "ITL CDF"), "ITL CDF"))
        worst = [m.worst_gap_s for m in done if m.worst_gap_s is not None]
        body.append(_img(p.histogram(worst, "ms", "worst gap per request"), "worst gap histogram"))
        body.append(_img(p.timeline(records), "request timeline"))
    body.append(
        "<h2>summary.json</h2><pre>" + html.escape(json.dumps(summary, indent=1)) + "</pre>"
    )
    Path(path).write_text(_page("kvserve bench serve", body), encoding="utf-8")


SWEEP_COLUMNS = (
    # header, width, cell(row)
    ("offered/s", 10, lambda r, lat: _num(r["offered_rps"])),
    ("realised/s", 11, lambda r, lat: _num(r.get("realised_rps"))),
    ("ok", 6, lambda r, lat: str(r["ok"])),
    ("not ok", 7, lambda r, lat: str(r["not_ok"])),
    ("req/s", 8, lambda r, lat: _num(r.get("requests_per_s"))),
    ("out tok/s", 11, lambda r, lat: _num(r.get("output_tokens_per_s"), ".1f")),
    ("p50 TTFT", 10, lambda r, lat: _ms(lat.get("ttft", {}).get("p50"))),
    ("p99 TTFT", 10, lambda r, lat: _ms(lat.get("ttft", {}).get("p99"))),
    ("p99 ITL", 9, lambda r, lat: _ms(lat.get("itl", {}).get("p99"))),
    ("p99 worst", 10, lambda r, lat: _ms(lat.get("worst_gap", {}).get("p99"))),
    ("goodput", 9, lambda r, lat: _num(r.get("goodput_rps"))),
    ("cache hit", 10, lambda r, lat: _num(r.get("prefix_cache_hit_rate"), ".0%")),
)


def sweep_table(rows: Sequence[dict]) -> str:
    """One line per rate; latencies in ms; `cache hit` is the server's prefix-cache hit rate."""
    lines = ["".join(f"{h:>{w}}" for h, w, _ in SWEEP_COLUMNS) + "   (latencies in ms)"]
    for r in rows:
        lat = r.get("latency_s") or {}
        lines.append("".join(f"{cell(r, lat):>{w}}" for _, w, cell in SWEEP_COLUMNS))
    return "\n".join(lines)


def write_sweep_html(
    path: Path, title: str, rows: Sequence[dict], extra: str = "", plots: bool = True
) -> None:
    body = [f"<pre>{html.escape(sweep_table(rows))}</pre>"]
    if extra:
        body.append(f"<pre>{html.escape(extra)}</pre>")
    if plots and any(r.get("latency_s") for r in rows):
        from kvserve.lab.bench import plots as p

        body.append(_img(p.load_curve(rows), "latency vs offered load"))
    body.append("<p>Each rate's full report is in its own directory (rate_*/report.html).</p>")
    Path(path).write_text(_page(title, body), encoding="utf-8")
