"""The batch-invariance report: JSON for machines, one screen for people."""

from __future__ import annotations

from typing import Any

from kvserve.lab.check.invariance import ShapeResult, Trace


def verdict(results: list[ShapeResult]) -> str:
    if all(r.num_diverged == 0 for r in results):
        return "batch-invariant: every shape gave the solo tokens"
    return (
        "NOT batch-invariant: some shapes changed the greedy tokens (see first differing position)"
    )


def build_report(
    target: dict[str, Any], config: dict[str, Any], refs: list[Trace], results: list[ShapeResult]
) -> dict[str, Any]:
    return {
        "what": "kvserve check batch-invariance: each prompt alone vs in batch shapes, greedy",
        "definitions": "docs/determinism.md",
        "target": target,
        "config": config,
        "num_prompts": len(refs),
        "reference": [
            {"prompt": i, "num_tokens": len(r.positions), "min_top_two_gap": _min_gap(r)}
            for i, r in enumerate(refs)
        ],
        "verdict": verdict(results),
        "invariant": all(r.num_diverged == 0 for r in results),
        "shapes": [r.to_json() for r in results],
    }


def _min_gap(trace: Trace) -> float | None:
    gaps = [p.top_two_gap for p in trace.positions if p.top_two_gap is not None]
    return min(gaps, default=None)


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def render_summary(report: dict[str, Any]) -> str:
    """One screen: a row per shape."""
    target = report["target"]
    fmt = f", {target['quantization']}" if target.get("quantization") else ""
    lines = [
        f"batch invariance of {target.get('model')} "
        f"({target.get('kind')}{fmt}): {report['num_prompts']} prompts x "
        f"{report['config'].get('max_tokens')} greedy tokens",
        f"{'shape':<18} {'diverged':>8} {'first diff':>10} {'max |dlogp|':>11} "
        f"{'min gap held':>12} {'gap at diff':>11}  notes",
    ]
    for shape in report["shapes"]:
        gaps = [p["gap_at_divergence"] for p in shape["prompts"] if p["gap_at_divergence"]]
        notes = ", ".join(f"{k}={v}" for k, v in shape["facts"].items())
        first = shape["earliest_divergence"]
        lines.append(
            f"{shape['name']:<18} {shape['num_diverged']:>4}/{shape['num_prompts']:<3} "
            f"{'-' if first is None else first:>10} {_g(shape['max_abs_logprob_diff']):>11} "
            f"{_g(shape['min_gap_argmax_held']):>12} {_g(min(gaps, default=None)):>11}  {notes}"
        )
    lines.append(report["verdict"])
    lines.append(
        "max |dlogp|: largest change of a top-k log probability (= logit less its position's "
        "log-sum-exp) up to the first differing token; gaps are top-two logit gaps of the solo run"
    )
    return "\n".join(lines) + "\n"
