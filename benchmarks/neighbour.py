"""TPOT at a fixed arrival rate, quiet and beside one busy-looping core, for several thread settings.

Each setting runs in a fresh subprocess (OpenMP reads its environment at start-up): requests arrive at
`--rate` req/s (fixed spacing) into the offline engine, which steps between arrivals; TPOT per request =
(last token - first token) / (n - 1); the report gives the median. "busy" starts one `while True: pass`
process beside it. The goal (docs/performance.md): with one busy core, TPOT grows by at most the share
of CPU lost (<= 2x).

    .venv/bin/python benchmarks/neighbour.py --model /tmp/kv/smol-gpt2 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _report import write_report  # benchmarks/ is on sys.path when a script runs

SETTINGS = {
    "default": {},
    "omp1": {"OMP_NUM_THREADS": "1"},
    "omp2-passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}


def worker(model: str, rate: float, num_requests: int, new_tokens: int) -> dict:
    import torch

    from kvserve import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory_bytes=256 * 1024**2, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.model.vocab_size
    prompts = torch.randint(3, vocab, (num_requests, 128), generator=gen).tolist()
    llm.generate(prompts[:1], params.with_updates(max_tokens=4))  # warm-up
    start = time.monotonic()
    next_arrival, added, finished = start, 0, []
    while len(finished) < num_requests:
        now = time.monotonic()
        while added < num_requests and now >= next_arrival:
            engine.add_request(f"r{added}", prompts[added], params)
            added += 1
            next_arrival = start + added / rate
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, next_arrival - time.monotonic()))
            continue
        finished += [o for o in engine.step() if o.finished]
    tpots = []
    for output in finished:
        times = output.outputs[0].metrics.token_times
        tpots.append((times[-1] - times[0]) / (len(times) - 1))
    return {"tpot_p50_ms": statistics.median(tpots) * 1e3, "tpot_max_ms": max(tpots) * 1e3,
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/kv/smol-gpt2")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/neighbour.json")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.rate, args.num_requests, args.new_tokens)))
        return
    rows = []
    for name in args.settings.split(","):
        row = {"setting": name, "env": SETTINGS[name]}
        for case in ("quiet", "busy"):
            loop = None
            if case == "busy":
                loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                cmd = [sys.executable, __file__, "--worker", "--model", args.model,
                       "--rate", str(args.rate), "--num-requests", str(args.num_requests),
                       "--new-tokens", str(args.new_tokens)]  # fmt: skip
                env = os.environ | SETTINGS[name]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                row[case] = json.loads(out.stdout.strip().splitlines()[-1])
            finally:
                if loop is not None:
                    loop.kill()
                    loop.wait()
        row["busy_over_quiet"] = row["busy"]["tpot_p50_ms"] / row["quiet"]["tpot_p50_ms"]
        rows.append(row)
        print(
            f"{name:14s} TPOT p50 quiet {row['quiet']['tpot_p50_ms']:7.1f} ms, busy "
            f"{row['busy']['tpot_p50_ms']:7.1f} ms (x{row['busy_over_quiet']:.2f})",
            flush=True,
        )
    report = {"benchmark": "neighbour", "model": args.model, "rate_req_s": args.rate,
              "num_requests": args.num_requests, "new_tokens": args.new_tokens, "rows": rows}  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
