"""Structured-output overhead: per-step grammar mask time, and output tokens/s with and without a JSON-schema
constraint, at batch 1 and batch 16, side by side in one run.

    .venv/bin/python benchmarks/structured.py [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _report import write_report  # benchmarks/ is on sys.path when a script runs

# Long documents: an array of small objects with no upper bound, so requests run to max_tokens mostly.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 12},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def measure(llm, batch: int, max_tokens: int, structured) -> dict:
    from kvserve import SamplingParams

    runner = llm.engine.runner
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=structured)
        for i in range(batch)
    ]
    prompts = [f"Record {i} as JSON:" for i in range(batch)]
    llm.generate(prompts[:1], params[:1])  # warm-up (and compile, for the constrained run)
    runner.grammar_mask_times_s.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    masks = sorted(runner.grammar_mask_times_s)
    steps = llm.engine.scheduler.stats.num_steps
    row = {
        "batch": batch,
        "constrained": structured is not None,
        "output_tokens": num_tokens,
        "wall_s": wall,
        "output_tokens_per_s": num_tokens / wall,
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
    }
    if masks:
        row["mask_ms_per_step"] = {
            "count": len(masks),
            "mean": statistics.fmean(masks) * 1e3,
            "p50": masks[len(masks) // 2] * 1e3,
            "p99": masks[min(len(masks) - 1, int(len(masks) * 0.99))] * 1e3,
        }
        row["mask_share_of_wall"] = sum(masks) / wall
        valid = [o for o in outputs if o.outputs[0].finish_reason == "stop"]
        row["num_complete_documents"] = len(valid)
        for o in valid:
            json.loads(o.outputs[0].text)  # a complete document parses
    row["engine_steps_total"] = steps
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: embedded demo target)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    args = parser.parse_args()

    import torch

    from kvserve import LLM
    from kvserve.core.sampling_params import StructuredOutput
    from kvserve.models import default_model_dir

    model = args.model or str(default_model_dir())
    llm = LLM(model)
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for structured in (None, constraint):
            row = measure(llm, batch, args.max_tokens, structured)
            rows.append(row)
            mask = row.get("mask_ms_per_step", {})
            print(
                f"batch {batch:2d} {'json_schema' if structured else 'free       '}: "
                f"{row['output_tokens_per_s']:7.1f} tok/s"
                + (
                    f", mask {mask['mean']:.3f} ms/step (p99 {mask['p99']:.3f}), "
                    f"{100 * row['mask_share_of_wall']:.1f}% of wall"
                    if mask
                    else ""
                )  # fmt: skip
            )
    vocab = llm.engine.config.model.vocab_size
    report = {
        "benchmark": "structured", "model": model, "vocab_size": vocab, "schema": SCHEMA,
        "max_tokens": args.max_tokens, "sampling": "temperature 1.0, seeded per request",
        "grammar_library": "xgrammar", "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
