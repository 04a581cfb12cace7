"""Quality of the default model as shipped and requantised: `kvserve eval compare` per format.

Each candidate against the fp32-dequantised model (`--reference-quantization fp32`: every GGUF block
dequantised to fp32) on the held-out prose and code in kvserve/assets/eval: perplexity, KL(p_ref ||
p_cand) mean and p99, top-1 agreement and greedy agreement (kvserve/quant/compare.py). Candidates:
the file's own blocks (no --quantization), the dequantised weights requantised into kvserve's
formats, and the file's blocks with an 8-bit KV cache. The reference is loaded and scored once per
text; each candidate is loaded once. Writes JSON and prints a markdown table.

    flock /tmp/kvserve-bench.lock env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality_table.py
    .venv/bin/python benchmarks/quality_table.py --model kvserve-demo --out /tmp/q.json  # plumbing
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _report import kvserve_llm, threads_used, write_report  # benchmarks/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EVAL_DIR = ROOT / "kvserve" / "assets" / "eval"
TEXTS = ("prose", "code")
REPORT_KEYS = ("ppl_candidate", "kl_mean", "kl_p99", "top1_agreement", "num_scored_tokens")


@dataclass(frozen=True)
class Row:
    label: str
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    gguf_activations: str = "fp32"


ROWS = (
    Row("file's blocks, as shipped"),
    Row("file's blocks, int8x2 activations", gguf_activations="int8x2"),
    Row("file's blocks, int8 activations", gguf_activations="int8"),
    Row("int8", "int8"),
    Row("int4-g32", "int4-g32"),
    Row("int4-g128", "int4-g128"),
    Row("linear=bf16,head=bf16", "linear=bf16,head=bf16"),
    Row("file's blocks, KV int8", kv_cache_dtype="int8"),
    Row("file's blocks, KV fp8", kv_cache_dtype="fp8"),
)


def select_rows(spec: str | None) -> list[Row]:
    """The rows `--rows` names (';'-separated: the labels hold commas), in table order; every row for
    None. An unknown label is an error, not a silently shorter table."""
    if spec is None:
        return list(ROWS)
    wanted = [label.strip() for label in spec.split(";")]
    unknown = sorted(set(wanted) - {r.label for r in ROWS})
    if unknown:
        raise SystemExit(f"--rows: unknown labels {unknown}")
    return [r for r in ROWS if r.label in wanted]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, dir or .gguf")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=None, help="first N tokens of each text")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument("--rows", default=None,
                   help="';'-separated labels (labels hold commas; default: every row)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality_table.json"))
    return p.parse_args()


def measure(args: argparse.Namespace) -> dict:
    from kvserve.models import resolve_model
    from kvserve.quant.compare import EvalModel, candidate_stats, reference_run, signed_report

    model_dir = resolve_model(args.model)
    reference = EvalModel(model_dir, "fp32")
    start = time.perf_counter()
    ref = reference.load(args.num_prompts)
    runs = {
        text: reference_run(
            ref,
            EVAL_DIR / f"{text}.jsonl",
            window=args.window,
            max_tokens=args.max_tokens,
            num_prompts=args.num_prompts,
            greedy_tokens=args.greedy_tokens,
        )  # fmt: skip
        for text in TEXTS
    }
    del ref
    print(f"reference scored in {time.perf_counter() - start:.0f} s", flush=True)
    chosen = select_rows(args.rows)
    rows = []
    for row in chosen:
        start = time.perf_counter()
        candidate = EvalModel(model_dir, row.quantization, kv_cache_dtype=row.kv_cache_dtype,
                              gguf_activations=row.gguf_activations)  # fmt: skip
        cand = candidate.load(args.num_prompts)
        result = {"label": row.label, "quantization": row.quantization,
                  "kv_cache_dtype": row.kv_cache_dtype,
                  "gguf_activations": row.gguf_activations}  # fmt: skip
        for text, run in runs.items():
            report = signed_report(reference, candidate, candidate_stats(run, cand))
            result[text] = {k: report[k] for k in REPORT_KEYS} | {
                "ppl_reference": report["ppl_reference"],
                "greedy_identical": report["greedy"]["identical_share"],
                "report_sha256": report["sha256"],
            }
        result["reference"] = report["reference"]
        result["candidate"] = report["candidate"]
        result["seconds"] = round(time.perf_counter() - start, 1)
        del cand
        gc.collect()
        rows.append(result)
        print(table_line(result), flush=True)
    return {
        "benchmark": "quality-table",
        "model": args.model,
        "model_dir": str(model_dir),
        "reference": "fp32 (every weight dequantised to fp32)",
        "texts": {t: str((EVAL_DIR / f"{t}.jsonl").relative_to(ROOT)) for t in TEXTS},
        "window": args.window,
        "max_tokens": args.max_tokens,
        "threads": threads_used(),
        "rows": rows,
    }


def table_line(row: dict) -> str:
    cells = [row["label"]]
    for text in TEXTS:
        r = row[text]
        cells += [f"{r['ppl_candidate']:.3f}", f"{r['kl_mean']:.5f}", f"{r['kl_p99']:.4f}",
                  f"{r['top1_agreement']:.3f}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def markdown(report: dict) -> str:
    first = report["rows"][0]
    lines = [
        "| candidate | prose ppl | KL mean | KL p99 | top-1 | code ppl | KL mean | KL p99 | top-1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| fp32 (dequantised, the reference) | {first['prose']['ppl_reference']:.3f} | | | "
        f"| {first['code']['ppl_reference']:.3f} | | | |",
    ]
    return "\n".join(lines + [table_line(row) for row in report["rows"]])


def main() -> None:
    args = parse_args()
    kvserve_llm()  # kvserve's thread defaults, before torch loads
    report = measure(args)
    write_report(args.out, report)
    tokens = {t: report["rows"][0][t]["num_scored_tokens"] for t in TEXTS}
    print(f"\nscored tokens: prose {tokens['prose']:,d}, code {tokens['code']:,d}; "
          f"window {args.window}\n")  # fmt: skip
    print(markdown(report))


if __name__ == "__main__":
    main()
