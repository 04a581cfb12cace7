"""TPOT at a fixed arrival rate, quiet and beside one busy-looping core, for several thread settings.

Each setting runs in a fresh subprocess (OpenMP reads its environment when torch loads libgomp):
requests arrive at `--rate` req/s (fixed spacing) into the offline engine, which steps between
arrivals; TPOT per request = (last token - first token) / (n - 1); the report gives the median. "busy"
starts one `while True: pass` process beside it (intended: that is the neighbour). `--rounds` repeats
every setting, quiet, busy, then "alone on one core" (quiet, pinned with `taskset` to one CPU: what
the busy case leaves it), in the same order, so the spread between rounds shows. `cores` is the
worker's CPU time over its wall time during the timed window. The goal (docs/performance.md "Threads"):
with one busy core, TPOT grows by at most the share of CPU lost (<= 2x); busy / one core is what
sharing costs beyond the CPU time the neighbour took (1.0: nothing). At a fixed arrival rate TPOT is
not linear in the CPU an engine has (the batch grows as the step slows), so busy / quiet can pass 2x
where one core is near its capacity even when busy / one core is 1.0.

`--target server` measures `kvserve serve MODEL` (engine core in its own process, the default)
instead, loaded by `kvserve bench serve` (completions, 128-token prompts, 64 forced output tokens, the
same rate and count; its TPOT p50); `cores` is then not measured.

Settings: `libgomp` is torch's OpenMP runtime as it comes (2 threads, each spinning 300,000 iterations
before it sleeps; the count is set explicitly, to the value libgomp uses when it is unset, so that
kvserve's default stays out); `kvserve` is what the `kvserve` command line applies when the variables
are unset (kvserve.threads.THREAD_DEFAULTS) with the engine's default thread policy (adaptive: a step
runs on one thread fewer while a neighbour takes CPU time from the OpenMP thread pool, kvserve.threads.ThreadPoolSizer);
`fixed` is the same with `--thread-policy fixed` (every step on all threads); the others set one
variable each (adaptive policy). `thread_changes` counts the thread pool's changes of size.

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/neighbour.py --model /tmp/kv/smol-gpt2 \
        [--rounds 2] [--settings libgomp,kvserve] [--target server] [--quantization FMT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _report import write_report  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server_utils import running_server  # noqa: E402

SETTINGS = {
    "libgomp": {"GOMP_SPINCOUNT": "300000"},  # libgomp's own when unset (<= 1 thread per CPU)
    "kvserve": {},  # kvserve.threads' defaults, applied before torch loads
    "fixed": {},  # the same, with --thread-policy fixed (every step on 2 threads)
    "omp1": {"OMP_NUM_THREADS": "1"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin100": {"GOMP_SPINCOUNT": "100"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "spin3k": {"GOMP_SPINCOUNT": "3000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
}
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
KVSERVE_DEFAULTS = ("kvserve", "fixed")  # settings that run with kvserve.threads' defaults
THREAD_POLICY = {"fixed": "fixed"}  # the engine's thread_policy where not the default (adaptive)


def worker(args: argparse.Namespace) -> dict:
    if args.kvserve_defaults:
        from kvserve.threads import apply_thread_defaults

        apply_thread_defaults()
    import torch

    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, kv_cache_memory_bytes=256 * 1024**2, enable_prefix_caching=False,
              thread_policy=args.thread_policy, quantization=args.quantization)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.model.vocab_size
    prompts = torch.randint(3, vocab, (args.num_requests, 128), generator=gen).tolist()
    llm.generate(prompts[:1], params.with_updates(max_tokens=4))  # warm-up
    start, cpu_start = time.monotonic(), time.process_time()
    next_arrival, added, finished = start, 0, []
    while len(finished) < args.num_requests:
        now = time.monotonic()
        while added < args.num_requests and now >= next_arrival:
            engine.add_request(f"r{added}", prompts[added], params)
            added += 1
            next_arrival = start + added / args.rate
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, next_arrival - time.monotonic()))
            continue
        finished += [o for o in engine.step() if o.finished]
    wall_s, cpu_s = time.monotonic() - start, time.process_time() - cpu_start
    tpots = []
    for output in finished:
        times = output.outputs[0].metrics.token_times
        tpots.append((times[-1] - times[0]) / (len(times) - 1))
    return {"tpot_p50_ms": statistics.median(tpots) * 1e3, "tpot_max_ms": max(tpots) * 1e3,
            "wall_s": wall_s, "cores": cpu_s / wall_s, "torch_threads": torch.get_num_threads(),
            "thread_changes": engine.runner.num_thread_changes,
            "env": {k: os.environ[k] for k in _THREAD_VARIABLES if k in os.environ}}  # fmt: skip


def serve_case(args: argparse.Namespace, env: dict[str, str], policy: str) -> dict:
    """One `kvserve serve` under `env`, loaded by `kvserve bench serve`; its TPOT p50."""
    serve_args = ("--no-prefix-caching", "--thread-policy", policy)
    if args.quantization:
        serve_args += ("--quantization", args.quantization)
    with running_server(args.model, *serve_args, timeout_s=300, env=env) as (url, _):
        threads = httpx.get(f"{url}/debug/steps?since=1000000000").json()["engine"].get("threads")
        with tempfile.TemporaryDirectory() as out:
            bench = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url,
                     "--endpoint", "completions", "--input-len", "128", "--output-len",
                     str(args.new_tokens), "--mode", "forced", "--request-rate", str(args.rate),
                     "--num-requests", str(args.num_requests), "--warmup", "1", "--out", out,
                     "--no-plots", "--no-progress"]  # fmt: skip
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
            summary = json.loads((Path(out) / "summary.json").read_text())
        metrics = httpx.get(f"{url}/metrics").text
    changes = [line.split()[-1] for line in metrics.splitlines()
               if line.startswith("kvserve_engine_thread_changes_total")]  # fmt: skip
    tpot = summary["latency_s"]["tpot"]
    return {"tpot_p50_ms": tpot["p50"] * 1e3, "tpot_max_ms": tpot["max"] * 1e3 if "max" in tpot
            else None, "threads": threads, "cores": None,
            "thread_changes": float(changes[0]) if changes else None,
            "env": {k: env[k] for k in _THREAD_VARIABLES if k in env}}  # fmt: skip


def run_case(args: argparse.Namespace, name: str, case: str) -> dict:
    """`case`: quiet, busy (one busy-looping process beside it) or one_core (quiet, but pinned to one
    CPU: the CPU that the busy case leaves it, so busy / one_core is what sharing costs beyond the
    CPU time it took; offline only)."""
    busy = case == "busy"
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        base = {k: v for k, v in os.environ.items() if k not in _THREAD_VARIABLES}
        policy = THREAD_POLICY.get(name, "adaptive")
        if args.target == "server":
            return serve_case(args, base | SETTINGS[name], policy)
        pin = ["taskset", "-c", str(max(os.sched_getaffinity(0)))] if case == "one_core" else []
        cmd = [*pin, sys.executable, __file__, "--worker", "--model", args.model,
               "--rate", str(args.rate), "--num-requests", str(args.num_requests),
               "--new-tokens", str(args.new_tokens), "--thread-policy", policy]  # fmt: skip
        if name in KVSERVE_DEFAULTS:
            cmd.append("--kvserve-defaults")
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        env = base | SETTINGS[name]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()


def summarise(name: str, runs: list[dict]) -> dict:
    quiet = [r["quiet"]["tpot_p50_ms"] for r in runs]
    busy = [r["busy"]["tpot_p50_ms"] for r in runs]
    one_core = [r["one_core"]["tpot_p50_ms"] for r in runs if "one_core" in r]  # offline only
    return {"setting": name, "env": runs[0]["quiet"]["env"], "quiet_tpot_p50_ms": quiet,
            "busy_tpot_p50_ms": busy, "one_core_tpot_p50_ms": one_core,
            "busy_over_quiet": [b / q for q, b in zip(quiet, busy, strict=True)],
            "busy_over_one_core": [r["busy"]["tpot_p50_ms"] / r["one_core"]["tpot_p50_ms"]
                                   for r in runs if "one_core" in r],
            "busy_cores": [r["busy"]["cores"] for r in runs],
            "quiet_cores": [r["quiet"]["cores"] for r in runs]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/kv/smol-gpt2")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--quantization", default=None, help="kvserve's --quantization (a format)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--target", choices=["offline", "server"], default="offline")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--thread-policy", default="adaptive", help=argparse.SUPPRESS)
    parser.add_argument("--kvserve-defaults", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/neighbour.json")
    args = parser.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    if args.worker:
        print(json.dumps(worker(args)))
        return
    names = args.settings.split(",")
    cases = ("quiet", "busy") + (("one_core",) if args.target == "offline" else ())
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names:
            run = {"round": round_index}
            for case in cases:
                run[case] = run_case(args, name, case)
            runs[name].append(run)
            quiet, busy = run["quiet"], run["busy"]
            one = f"{run['one_core']['tpot_p50_ms']:6.1f} ms" if "one_core" in run else "-"
            print(
                f"round {round_index} {name:9s} TPOT p50 quiet {quiet['tpot_p50_ms']:6.1f} ms "
                f"({quiet['cores'] or 0:.2f} cores), busy {busy['tpot_p50_ms']:6.1f} ms "
                f"({busy['cores'] or 0:.2f} cores), x{busy['tpot_p50_ms'] / quiet['tpot_p50_ms']:.2f}; "
                f"alone on one core {one}",
                flush=True,
            )
    rows = [summarise(name, runs[name]) for name in names]
    print("\n| setting | quiet TPOT p50 | one busy core | busy / quiet | alone on one core "
          "| busy / one core |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for row in rows:
        cells = [
            " / ".join(f"{v:.0f}" for v in row[k]) or "-"
            for k in ("quiet_tpot_p50_ms", "busy_tpot_p50_ms", "one_core_tpot_p50_ms")
        ]
        ratios = [" / ".join(f"{v:.2f}x" for v in row[k]) or "-"
                  for k in ("busy_over_quiet", "busy_over_one_core")]  # fmt: skip
        print(f"| {row['setting']} | {cells[0]} ms | {cells[1]} ms | {ratios[0]} | {cells[2]} ms "
              f"| {ratios[1]} |")  # fmt: skip
    report = {"benchmark": "neighbour", "target": args.target, "model": args.model,
              "rate_req_s": args.rate, "quantization": args.quantization,
              "num_requests": args.num_requests, "new_tokens": args.new_tokens,
              "rounds": args.rounds, "rows": rows, "runs": runs}  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
