"""Time from `kvserve serve` (as `make serve` runs it) to the first chat reply, in seconds.

Starts the server with the default model on a free port, polls /v1/chat/completions until a reply
arrives and reports: the seconds until /health answers, until the first reply, and the reply itself.
Repeats --runs times (a fresh process each run) and reports each and the median.

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/first_reply.py [--runs 3] [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server_utils import free_port  # noqa: E402

PROMPT = "Write a Python function that adds two numbers."


def one_run(model: str | None, timeout_s: float) -> dict:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvserve",
        "serve",
        *([model] if model else []),
        "--port",
        str(port),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    health_s = None
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64, "temperature": 0}
    try:
        with httpx.Client(timeout=30) as client:
            while time.perf_counter() - start < timeout_s:
                try:
                    if health_s is None and client.get(f"{url}/health").status_code == 200:
                        health_s = time.perf_counter() - start
                    if health_s is not None:
                        r = client.post(
                            f"{url}/v1/chat/completions", json={"model": "kvserve-demo"} | body
                        )
                        if r.status_code == 200:
                            reply = r.json()["choices"][0]
                            return {
                                "health_s": round(health_s, 2),
                                "first_reply_s": round(time.perf_counter() - start, 2),
                                "finish_reason": reply["finish_reason"],
                                "reply": reply["message"]["content"],
                            }
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"no reply within {timeout_s} s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh server processes")
    parser.add_argument("--model", default=None, help="model (default: the server's default)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="give up after this")
    args = parser.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    runs = [one_run(args.model, args.timeout_s) for _ in range(args.runs)]
    median = statistics.median(r["first_reply_s"] for r in runs)
    print(json.dumps({"runs": runs, "median_first_reply_s": median}, indent=2))


if __name__ == "__main__":
    main()
