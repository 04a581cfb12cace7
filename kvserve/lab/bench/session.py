"""What one `kvserve bench serve` invocation does: a single run, a sweep of rates, or a capacity
search.

A sweep writes one run directory per rate (`rate_*`), `sweep.json` and an overview `report.html`; a
capacity search writes one per trial (`trial_NN_rate_*`), `capacity.json` and an overview. Every
rate uses the identical sampled workload and the same arrival pattern, scaled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvserve.lab.bench import report
from kvserve.lab.bench.capacity import Trial, find_capacity
from kvserve.lab.bench.runner import (
    SCHEMA,
    ServeConfig,
    Target,
    Workload,
    connect,
    execute_run,
    log,
)
from kvserve.lab.bench.slo import passes
from kvserve.lab.bench.summary import json_safe


def sweep_row(summary: dict, offered_rps: float, run_dir: Path, min_attainment: float) -> dict:
    c = summary["counts"]
    hit_rate = summary["metadata"]["server_counters"]["prefix_cache_hit_rate"]
    row = {
        "prefix_cache_hit_rate": hit_rate,
        "prefix_cache_reset": summary["metadata"]["prefix_cache_reset"]["status"],
        "offered_rps": offered_rps,
        "dir": str(run_dir),
        "ok": c["ok"],
        "not_ok": c["measured"] - c["ok"],
    }
    if summary.get("window"):
        t, g = summary["throughput"], summary["goodput"]
        row |= {
            "realised_rps": summary["arrivals"]["realised_rate_rps"],
            "requests_per_s": t["requests_per_s"],
            "output_tokens_per_s": t["output_tokens_per_s"],
            "latency_s": summary["latency_s"],
            "goodput_rps": g[0]["goodput_rps"] if g else None,
            "passed": passes(g[0], min_attainment) if g else None,
        }
    return row


def reset_note(rows: list[dict], requested: bool) -> str:
    """Whether every rate started from an empty prefix cache, for the sweep's summary."""
    if not requested:
        return (
            "prefix cache NOT reset between rates (--reset-prefix-cache not given): every rate "
            "sends the same prompts, so a server with prefix caching may serve later rates' "
            "prompts from cache (see the cache hit column, when the server reports it)"
        )
    statuses = sorted({r["prefix_cache_reset"] for r in rows})
    if statuses == ["ok"]:
        return "prefix cache reset before every rate (POST /reset_prefix_cache)"
    return (
        f"prefix cache reset requested, but the server answered {', '.join(statuses)}: later "
        "rates may still hit the cache of earlier ones' prompts"
    )


def _rate_dir(out: Path, rate: float) -> Path:
    return out / ("rate_inf" if math.isinf(rate) else f"rate_{rate:g}")


def run_serve(cfg: ServeConfig) -> int:
    """Run what cfg asks for; 0 when done, 130 when interrupted (the results so far are written)."""
    target = connect(cfg)
    workload = Workload(cfg, target.counter, target)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if cfg.sweep_rates:
            return _sweep(cfg, target, workload, out)
        if cfg.find_capacity:
            return _capacity(cfg, target, workload, out)
        summary = execute_run(cfg, target, workload, cfg.arrivals, out)
        log(f"wrote {out}/summary.json, requests.jsonl, report.html")
        return 130 if summary["metadata"]["interrupted"] else 0
    finally:
        target.counter.close()


def _sweep(cfg: ServeConfig, target: Target, workload: Workload, out: Path) -> int:
    rows = []
    for rate in cfg.sweep_rates:
        run_dir = _rate_dir(out, rate)
        summary = execute_run(cfg, target, workload, cfg.arrivals.with_rate(rate), run_dir)
        rows.append(sweep_row(summary, rate, run_dir, cfg.min_attainment))
        if summary["metadata"]["interrupted"]:
            break
    doc = {
        "schema": SCHEMA + "/sweep",
        "rates": list(cfg.sweep_rates),
        "rows": rows,
        "objective": cfg.objective_sets[0].name if cfg.objective_sets else None,
        "prefix_cache_reset": cfg.reset_prefix_cache,
        "note": reset_note(rows, cfg.reset_prefix_cache),
    }
    (out / "sweep.json").write_text(json.dumps(json_safe(doc), indent=1), encoding="utf-8")
    report.write_sweep_html(
        out / "report.html", "kvserve bench serve: sweep", rows, plots=cfg.plots
    )
    print(report.sweep_table(rows) + "\n" + doc["note"], flush=True)
    return 130 if len(rows) < len(cfg.sweep_rates) or summary["metadata"]["interrupted"] else 0


def _capacity(cfg: ServeConfig, target: Target, workload: Workload, out: Path) -> int:
    rows: list[dict] = []
    interrupted = False

    def evaluate(rate: float) -> Trial:
        nonlocal interrupted
        if interrupted:
            return Trial(rate, False, {"skipped": "interrupted"})
        run_dir = out / f"trial_{len(rows):02d}_{_rate_dir(out, rate).name}"
        summary = execute_run(cfg, target, workload, cfg.arrivals.with_rate(rate), run_dir)
        interrupted = summary["metadata"]["interrupted"]
        row = sweep_row(summary, rate, run_dir, cfg.min_attainment)
        rows.append(row)
        return Trial(rate, bool(row.get("passed")) and not interrupted, {"dir": str(run_dir)})

    result = find_capacity(
        evaluate,
        cfg.capacity_start_rps,
        cfg.capacity_max_rps,
        cfg.capacity_rel_tol,
        cfg.capacity_max_trials,
    )
    objective = cfg.objective_sets[0]
    criterion = (
        f"{objective.name}"
        if objective.style == "pooled"
        else f"{objective.name}, attainment >= {cfg.min_attainment:.0%}"
    )
    doc = {"schema": SCHEMA + "/capacity", "criterion": criterion, "interrupted": interrupted}
    doc |= result.to_json()
    (out / "capacity.json").write_text(json.dumps(json_safe(doc), indent=1), encoding="utf-8")
    cap = result.capacity_rps
    text = (
        f"capacity: {'none (the lowest rate failed)' if cap is None else f'{cap:.3g} req/s'}"
        f"{' (lower bound: no tested rate failed)' if result.lower_bound_only else ''}"
        f" for {criterion}"
        f"; non-monotonic rates: {list(result.non_monotonic) or 'none'}"
    )
    ordered = sorted(rows, key=lambda r: r["offered_rps"])
    report.write_sweep_html(
        out / "report.html", "kvserve bench serve: capacity", ordered, text, plots=cfg.plots
    )
    print(report.sweep_table(ordered) + "\n" + text, flush=True)
    return 130 if interrupted else 0
