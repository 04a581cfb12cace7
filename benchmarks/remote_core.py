"""The per-message cost of an engine core on another host against a local one (docs/parallel.md,
"Engine cores on other hosts").

Three ways for one API-side client (kvserve.engine.mp_client.MPClient) to reach one engine core:

  local           the core is the client's child, over ZMQ ipc sockets (`kvserve serve`'s default)
  remote-lo       `kvserve engine-core` on 127.0.0.1 of the client's host: TCP over loopback, the
                  HMAC-tagged frames and the core host's relay (its ipc hop) included
  remote-veth     `kvserve engine-core` in another network namespace, over a veth pair (tests/netns.py)

Measured for each: (1) the round trip of a utility call (`reset_prefix_cache`: one message each way
and a wake-up of the core's loop), median and p90 of 300 after 20 warm-up; (2) the gaps between the
deltas of one greedy request of 64 tokens (one CoreOutputs message per step), median of the gaps of
5 requests. The model is tests/checkpoints.py's tiny Llama (hidden 64), so a step costs little and
the link's share shows. remote-veth needs root (network namespaces); without it that row is skipped.

  sudo python benchmarks/remote_core.py --out benchmarks/results/zen3_avx2/remote_core.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECRET = "remote-core-benchmark-secret-0123456789"
ENGINE = ("--max-model-len", "256", "--num-blocks", "256", "--block-size", "16")
PORT = 29650
NUM_CALLS, NUM_WARMUP = 300, 20
NUM_TOKENS, NUM_REQUESTS = 64, 5


def _start_core(command_prefix: list[str], model_dir: Path, host: str, log: Path):
    argv = [*command_prefix, sys.executable, "-m", "kvserve", "engine-core", str(model_dir),
            "--host", host, "--port", str(PORT), *ENGINE]  # fmt: skip
    env = {**os.environ, "KVSERVE_DIST_SECRET": SECRET, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(config, remote: list[str]) -> dict:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.mp_client import MPClient

    client = MPClient(config, num_cores=0 if remote else 1, remote_cores=remote)
    try:
        rtts = []
        for i in range(NUM_WARMUP + NUM_CALLS):
            t0 = time.perf_counter()
            client.call("reset_prefix_cache")
            if i >= NUM_WARMUP:
                rtts.append(time.perf_counter() - t0)
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)

        async def one(request_id: str) -> list[float]:
            times = []
            stream = client.add(request_id, list(range(1, 33)), params)
            async for _ in stream:
                times.append(time.perf_counter())
            return [b - a for a, b in zip(times, times[1:], strict=False)]

        gaps = []
        for r in range(NUM_REQUESTS):
            gaps += asyncio.run(one(f"r{r}"))
        return {
            "rtt_us_median": statistics.median(rtts) * 1e6,
            "rtt_us_p90": _percentile(rtts, 0.9) * 1e6,
            "delta_gap_ms_median": statistics.median(gaps) * 1e3,
            "delta_gap_ms_p90": _percentile(gaps, 0.9) * 1e3,
            "num_calls": NUM_CALLS,
            "num_gaps": len(gaps),
        }
    finally:
        client.shutdown()


def run(out: Path | None) -> dict:
    from kvserve.engine.args import build_engine_config
    from tests.checkpoints import build_gpt2_tokenized_checkpoint
    from tests.netns import NetnsUnavailable, two_hosts

    os.environ["KVSERVE_DIST_SECRET"] = SECRET
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="kvserve-remote-bench-"))
    model_dir = work / "model"
    build_gpt2_tokenized_checkpoint(model_dir)
    config = build_engine_config(model_dir, max_model_len=256, num_blocks=256, block_size=16)
    rows: dict[str, dict] = {"local": measure(config, [])}
    core = _start_core([], model_dir, "127.0.0.1", work / "lo.log")
    try:
        rows["remote-lo"] = measure(config, [f"127.0.0.1:{PORT}"])
    finally:
        core.kill()
        core.wait()
    note = ""
    try:
        with two_hosts() as (a, b):
            core = _start_core(b.command(), model_dir, b.address, work / "veth.log")
            try:  # this client in A: its sockets are opened by a thread inside A's namespace
                with a.executor(1) as pool:
                    rows["remote-veth"] = pool.submit(
                        measure, config, [f"{b.address}:{PORT}"]
                    ).result()
            finally:
                core.kill()
                core.wait()
    except NetnsUnavailable as exc:
        note = f"remote-veth skipped: {exc}"
    result = {
        "benchmark": "remote_core",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "model": "tests/checkpoints.py tiny Llama (hidden 64, GPT-2 tokenizer), fp32",
        "rows": rows,
        "note": note,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict) -> str:
    lines = ["| path | utility round trip: median / p90 | gap between deltas: median / p90 |",
             "|---|---|---|"]  # fmt: skip
    for name, row in result["rows"].items():
        lines.append(
            f"| {name} | {row['rtt_us_median']:.0f} / {row['rtt_us_p90']:.0f} us | "
            f"{row['delta_gap_ms_median']:.2f} / {row['delta_gap_ms_p90']:.2f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="reprint a result file's table")
    args = parser.parse_args()
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return
    result = run(args.out)
    print(table(result))
    if result["note"]:
        print(result["note"])


if __name__ == "__main__":
    main()
