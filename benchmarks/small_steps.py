"""A small prompt chunk run row by row (the fused step) against the same chunk attended at once (the
per-op path, torch's flash kernel), alternated in one process (docs/performance.md "Small steps row
by row").

For each `--rows` N (and each `--starts` S: tokens already in the cache before the chunk), one forward
of an N-token chunk at positions S .. S + N - 1 through `runner.forward.forward_chunks` (logits of the
last row, as a prompt's last chunk samples), `--reps` times each way, A B A B: `rows` is the engine's
choice for such a step (every token a decode row: one native call for all layers), `chunk` the same
step with `PER_ROW_MAX_WORK` set to 0 (the per-op path, as before). Reports the medians, their ratio
and the largest logit difference between the two.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/small_steps.py --model /tmp/kv/smol-gpt2 \
        [--rows 16,32,64] [--starts 0] [--reps 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _report import kvserve_llm, write_report  # benchmarks/ is on sys.path when a script runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/kv/smol-gpt2")
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--starts", default="0")
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/small_steps.json")
    args = parser.parse_args()
    LLM = kvserve_llm()
    import torch

    from kvserve.model import fused_decode
    from kvserve.runner import forward

    llm = LLM(args.model, enable_prefix_caching=False, kv_cache_memory_bytes=512 * 1024**2,
              thread_policy="fixed")  # fmt: skip
    runner = llm.engine.runner
    block_size = runner.block_size
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for start in map(int, args.starts.split(",")):
        for n in map(int, args.rows.split(",")):
            tokens = tuple(torch.randint(3, runner.vocab_size, (n,), generator=gen).tolist())
            blocks = tuple(range(1, 1 + -(-(start + n) // block_size)))
            chunk = [(start, tokens, blocks)]
            per_row = forward.attends_by_row(start, n) and n <= fused_decode.max_step_rows()

            def run(chunk=chunk, n=n):
                return forward_chunks_timed(forward, runner, chunk, n)

            bound = forward.PER_ROW_MAX_WORK
            times: dict[str, list[float]] = {"rows": [], "chunk": []}
            logits = {}
            with torch.inference_mode():
                for rep in range(args.reps + 1):  # the first pair warms up
                    for way in ("rows", "chunk"):
                        forward.PER_ROW_MAX_WORK = bound if way == "rows" else 0
                        try:
                            seconds, logits[way] = run()
                        finally:
                            forward.PER_ROW_MAX_WORK = bound
                        if rep:
                            times[way].append(seconds)
            med = {way: statistics.median(t) for way, t in times.items()}
            row = {"rows": n, "start": start, "runs_row_by_row": per_row,
                   "rows_ms": med["rows"] * 1e3, "chunk_ms": med["chunk"] * 1e3,
                   "chunk_over_rows": med["chunk"] / med["rows"],
                   "max_logit_diff": float((logits["rows"] - logits["chunk"]).abs().max()),
                   "samples_ms": {w: [t * 1e3 for t in ts] for w, ts in times.items()}}  # fmt: skip
            rows_out.append(row)
            print(f"{n:3d} rows at {start:5d}: row by row {row['rows_ms']:7.1f} ms, chunk at once "
                  f"{row['chunk_ms']:7.1f} ms, x{row['chunk_over_rows']:.2f} "
                  f"(engine runs it row by row: {per_row}; max |dlogit| "
                  f"{row['max_logit_diff']:.1e})", flush=True)  # fmt: skip
    write_report(args.out, {"benchmark": "small_steps", "model": args.model, "reps": args.reps,
                            "threads": torch.get_num_threads(), "rows": rows_out})  # fmt: skip


def forward_chunks_timed(forward, runner, chunk, n: int):
    start = time.perf_counter()
    logits = forward.forward_chunks(runner.model, runner.kv_caches, runner.attention, chunk,
                                    runner.block_size, runner.device, [n - 1])  # fmt: skip
    return time.perf_counter() - start, logits


if __name__ == "__main__":
    main()
