"""Two source trees of kvserve served alternately (A B A B) under one load: the regression check of a
change to the serving path (issue 47: the serving benchmark, before vs after, ratio >= 0.97).

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/serving_ab.py \
        --a /tmp/wt-before --b . [--model smollm2-135m-instruct] [--rounds 2] [--server-args "..."] \
        --out benchmarks/results/zen3_avx2/serving_ab.json

Each round starts `kvserve serve MODEL` from one tree (PYTHONPATH), waits for /ready, runs
`kvserve bench serve` (completions, 128-token prompts, 64 forced tokens, greedy) once at saturation
(every request at once) and once at a fixed Poisson rate, and stops the server. The JSON keeps each
round's summary; the printed table gives output tokens/s, TTFT and TPOT medians per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server_utils import free_port  # noqa: E402


def serve(tree: Path, model: str, port: int, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    cmd = [
        sys.executable,
        "-m",
        "kvserve",
        "serve",
        model,
        "--port",
        str(port),
        "--no-prefix-caching",
        *extra,
    ]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server from {tree} exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"the server from {tree} was not ready in 300 s")


def load(port: int, rate: str, num_requests: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "kvserve",
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--endpoint",
            "completions",
            "--input-len",
            "128",
            "--output-len",
            "64",
            "--mode",
            "forced",
            "--request-rate",
            rate,
            "--num-requests",
            str(num_requests),
            "--warmup",
            "2",
            "--no-progress",
            "--no-plots",
            "--out",
            out,
        ]
        subprocess.run(
            cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT))
        )
        return json.loads((Path(out) / "summary.json").read_text())


def headline(summary: dict) -> dict:
    throughput, latency = summary.get("throughput", {}), summary.get("latency_s", {})
    return {
        "output_tok_s": throughput.get("output_tokens_per_s"),
        "req_s": throughput.get("requests_per_s"),
        "ttft_p50_s": latency.get("ttft", {}).get("p50"),
        "tpot_p50_s": latency.get("tpot", {}).get("p50"),
        "failed": summary.get("counts", {}).get("failed"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="source tree A (e.g. before)")
    parser.add_argument("--b", type=Path, required=True, help="source tree B (e.g. after)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", default="2", help="the fixed rate, requests/s")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serving_ab.json"))
    parser.add_argument(
        "--server-args",
        default="",
        help="more `kvserve serve` flags for both trees, one string (e.g. '--gguf-activations fp32' "
        "to compare two trees whose defaults differ on the same products)",
    )
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        for name, tree in (("A", args.a), ("B", args.b)):
            port = free_port()
            server = serve(tree, args.model, port, args.server_args.split())
            try:
                row = {"round": i, "tree": name, "path": str(tree), "load_average": os.getloadavg()}
                for rate in ("inf", args.rate):
                    row[f"rate_{rate}"] = load(port, rate, args.num_requests)
                rounds.append(row)
                print(
                    name, i, {r: headline(row[f"rate_{r}"]) for r in ("inf", args.rate)}, flush=True
                )
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"model": args.model, "server_args": args.server_args, "rounds": rounds}
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
