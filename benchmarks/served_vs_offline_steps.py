"""A decode step's time served and offline, by its number of rows: does serving add to the step?

Offline: the engine itself (`LLM`), `--requests` requests of 128 random tokens added at once, 64
forced tokens each, prefix caching off; every step of decode rows only is timed around
`engine.step()`. Served: `kvserve serve` with the same options, loaded by `kvserve bench serve` with
the same requests all at once (completions, forced tokens); the steps come from the server's own step
log (`/debug/steps`, `step_s`: the engine step on the core's loop thread). Beside them, the CPU time
the API process and the engine-core process used while the load ran (/proc/PID/stat). Medians per
row count, ms.

    flock -x /tmp/kvserve-bench.lock env PYTHONPATH=. .venv/bin/python \\
        benchmarks/served_vs_offline_steps.py [--model smollm2-135m-instruct] [--requests 16] \\
        [--out benchmarks/results/served_vs_offline_steps.json]
"""

from __future__ import annotations

import argparse
import collections
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

PROMPT_TOKENS = 128
NEW_TOKENS = 64


def medians(by_rows: dict[int, list[float]]) -> dict[int, dict]:
    return {
        rows: {"steps": len(times), "median_ms": statistics.median(times) * 1e3}
        for rows, times in sorted(by_rows.items())
    }


def offline(model: str, requests: int) -> dict:
    import torch

    from kvserve import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.model.vocab_size
    prompts = torch.randint(3, vocab, (requests, PROMPT_TOKENS), generator=gen).tolist()
    params = SamplingParams(
        max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0, ignore_eos=True
    )
    llm.generate(prompts[:1], params.with_updates(max_tokens=4, min_tokens=0))  # warm-up
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    by_rows: dict[int, list[float]] = collections.defaultdict(list)
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        chunks = engine.last_scheduler_output.chunks
        if chunks and all(c.num_tokens == 1 for c in chunks):
            by_rows[len(chunks)].append(elapsed)
    return medians(by_rows)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def core_pid(api_pid: int) -> int | None:
    """The engine-core child of the API process (spawned: its command line names multiprocessing)."""
    children = Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing" in cmdline and b"spawn" in cmdline:
            return int(child)
    return None


def served(model: str, requests: int) -> dict:
    with running_server(model, "--no-prefix-caching") as (url, process):
        core = core_pid(process.pid)
        before = {"api": cpu_seconds(process.pid), "core": cpu_seconds(core) if core else None}
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as out:
            bench = [
                sys.executable,
                "-m",
                "kvserve.cli",
                "bench",
                "serve",
                "--base-url",
                url,
                "--endpoint",
                "completions",
                "--input-len",
                str(PROMPT_TOKENS),
                "--output-len",
                str(NEW_TOKENS),
                "--mode",
                "forced",
                "--request-rate",
                "inf",
                "--num-requests",
                str(requests),
                "--warmup",
                "1",
                "--out",
                out,
                "--no-plots",
                "--no-progress",
            ]
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        wall_s = time.monotonic() - started
        cpu = {"api": cpu_seconds(process.pid) - before["api"]}
        if core:
            cpu["core"] = cpu_seconds(core) - before["core"]
        steps = httpx.get(f"{url}/debug/steps", params={"since": 0}, timeout=30).json()["steps"]
    by_rows: dict[int, list[float]] = collections.defaultdict(list)
    for step in steps:
        chunks = step["chunks"]  # (new tokens, start, kind, proposals) per chunk
        if chunks and all(c[0] == 1 for c in chunks):
            by_rows[len(chunks)].append(step["step_s"])
    return {"wall_s": wall_s, "cpu_s": cpu, "steps": medians(by_rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/served_vs_offline_steps.json")
    args = parser.parse_args()
    report = {
        "benchmark": "served_vs_offline_steps",
        "model": args.model,
        "requests": args.requests,
        "offline": offline(args.model, args.requests),
        "served": served(args.model, args.requests),
    }
    served_steps = report["served"]["steps"]
    print("| rows | offline median ms (steps) | served median ms (steps) |\n|---:|---:|---:|")
    for rows in sorted(set(report["offline"]) | set(served_steps)):
        cells = []
        for side in (report["offline"], served_steps):
            row = side.get(rows)
            cells.append("-" if row is None else f"{row['median_ms']:.1f} ({row['steps']})")
        print(f"| {rows} | {cells[0]} | {cells[1]} |")
    cpu = report["served"]["cpu_s"]
    print(
        f"served: {report['served']['wall_s']:.1f} s; CPU "
        + ", ".join(f"{k} {v:.2f} s" for k, v in cpu.items())
    )
    write_report(args.out, report)


if __name__ == "__main__":
    main()
