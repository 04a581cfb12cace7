"""`kvserve bench compare RUN_A RUN_B`: metric deltas, and whether both runs did the same work.

A speedup claim needs identical outputs first (docs/load-tests.md): measured requests are matched by
workload index (same seed and index give the same prompt; the prompt hash is checked) and their
output hashes compared. Different modes, workloads, models or sampling are flagged as not
comparable.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.lab.bench.records import BenchError, RequestRecord, read_jsonl

LATENCY_KEYS = ("ttft", "tpot", "itl", "itl_token", "worst_gap", "e2e")
QUANTILE_KEYS = ("p50", "p90", "p99", "max")


def load_run(path: str | Path) -> tuple[dict, list[RequestRecord]]:
    run = Path(path)
    if not (run / "summary.json").is_file() or not (run / "requests.jsonl").is_file():
        hint = (
            " (a sweep: pass one of its rate_* directories)"
            if (run / "sweep.json").exists()
            else ""
        )
        raise BenchError(
            f"{run} is not a bench run directory: needs summary.json and requests.jsonl{hint}"
        )
    try:
        summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:  # an empty or cut summary
        raise BenchError(
            f"{run}/summary.json is not valid JSON ({exc}): an interrupted run?"
        ) from None
    if not isinstance(summary, dict):
        raise BenchError(f"{run}/summary.json is not a bench summary (not a JSON object)")
    return summary, read_jsonl(run / "requests.jsonl")


def _delta(name: str, a: float | None, b: float | None) -> dict:
    num = lambda x: isinstance(x, int | float)  # noqa: E731
    diff = b - a if num(a) and num(b) else None
    rel = diff / a if diff is not None and a else None
    return {"metric": name, "a": a, "b": b, "delta": diff, "relative": rel}


def metric_deltas(sa: dict, sb: dict) -> list[dict]:
    rows = []
    ta, tb = sa.get("throughput") or {}, sb.get("throughput") or {}
    for key in ("requests_per_s", "output_tokens_per_s", "total_output_tokens"):
        rows.append(_delta(key, ta.get(key), tb.get(key)))
    la, lb = sa.get("latency_s") or {}, sb.get("latency_s") or {}
    for key in LATENCY_KEYS:
        for q in QUANTILE_KEYS:
            rows.append(
                _delta(f"{key}_{q}_s", (la.get(key) or {}).get(q), (lb.get(key) or {}).get(q))
            )
    goodput_b = {g["name"]: g for g in sb.get("goodput", [])}
    for g in sa.get("goodput", []):
        if g["name"] in goodput_b:
            rows.append(
                _delta(
                    f"goodput_rps [{g['name']}]",
                    g["goodput_rps"],
                    goodput_b[g["name"]]["goodput_rps"],
                )
            )
    for key in ("ok", "failed", "rejected", "timeout", "cancelled"):
        rows.append(_delta(f"count_{key}", sa["counts"].get(key), sb["counts"].get(key)))
    return rows


def output_identity(ra: list[RequestRecord], rb: list[RequestRecord]) -> dict:
    """Match measured requests by workload index; compare prompt and output hashes."""
    a = {r.index: r for r in ra if r.phase == "measured"}
    b = {r.index: r for r in rb if r.phase == "measured"}
    identical, differing, prompt_mismatch, not_comparable = [], [], [], []
    for index in sorted(a.keys() & b.keys()):
        x, y = a[index], b[index]
        if x.prompt_sha256 != y.prompt_sha256:
            prompt_mismatch.append(index)
        elif x.outcome != "ok" or y.outcome != "ok":
            not_comparable.append(index)
        elif x.output_sha256 == y.output_sha256:
            identical.append(index)
        else:
            differing.append(index)
    only = sorted(a.keys() ^ b.keys())
    return {
        "num_matched": len(a.keys() & b.keys()),
        "num_identical": len(identical),
        "differing_indices": differing,
        "prompt_mismatch_indices": prompt_mismatch,
        "not_both_ok_indices": not_comparable,
        "only_in_one_run_indices": only,
        "all_identical": not (differing or prompt_mismatch or not_comparable or only)
        and bool(identical),
    }


def _setting(summary: dict, *path: str):
    node = summary.get("metadata", {})
    for key in path:
        node = node.get(key, {}) if isinstance(node, dict) else {}
    return node if node != {} else None


def comparability(sa: dict, sb: dict) -> list[str]:
    """Settings that differ between the runs and make their numbers not directly comparable."""
    notes = []
    for path in (
        ("mode",),
        ("workload",),
        ("target", "model"),
        ("target", "endpoint"),
        ("sampling",),
        ("arrivals",),
        ("measurement", "num_warmup"),
    ):
        va, vb = _setting(sa, *path), _setting(sb, *path)
        if va != vb:
            notes.append(f"{'.'.join(path)} differs: {json.dumps(va)} vs {json.dumps(vb)}")
    temperature = (_setting(sa, "sampling") or {}).get("temperature")
    if temperature:
        notes.append(f"temperature {temperature} > 0: outputs may differ by sampling alone")
    return notes


def compare_runs(path_a: str | Path, path_b: str | Path) -> dict:
    sa, ra = load_run(path_a)
    sb, rb = load_run(path_b)
    return {
        "a": str(path_a),
        "b": str(path_b),
        "metrics": metric_deltas(sa, sb),
        "outputs": output_identity(ra, rb),
        "not_comparable": comparability(sa, sb),
    }


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))


def format_comparison(doc: dict) -> str:
    lines = [
        f"A = {doc['a']}",
        f"B = {doc['b']}",
        f"{'metric':<40}{'A':>12}{'B':>12}{'B-A':>12}{'rel':>9}",
    ]
    for row in doc["metrics"]:
        if row["a"] is None and row["b"] is None:
            continue
        rel = "-" if row["relative"] is None else f"{row['relative']:+.1%}"
        lines.append(
            f"{row['metric']:<40}{_fmt(row['a']):>12}{_fmt(row['b']):>12}"
            f"{_fmt(row['delta']):>12}{rel:>9}"
        )
    o = doc["outputs"]
    verdict = "IDENTICAL" if o["all_identical"] else "DIFFER"
    lines.append(
        f"outputs: {verdict}: {o['num_identical']}/{o['num_matched']} matched requests "
        "identical by hash"
    )
    for key in (
        "differing_indices",
        "prompt_mismatch_indices",
        "not_both_ok_indices",
        "only_in_one_run_indices",
    ):
        if o[key]:
            shown = ", ".join(map(str, o[key][:20])) + (" ..." if len(o[key]) > 20 else "")
            lines.append(f"  {key.replace('_', ' ')} ({len(o[key])}): {shown}")
    for note in doc["not_comparable"]:
        lines.append(f"NOT COMPARABLE: {note}")
    if not o["all_identical"]:
        lines.append(
            "a speedup claim needs identical outputs on both sides first (docs/load-tests.md)"
        )
    return "\n".join(lines)
