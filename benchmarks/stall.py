"""Event-loop and engine stalls: the worst inter-chunk gap of a running stream while, one at a time, heavy
requests arrive (a 10 MB prompt, a 7 MB prompt under the body limit, a 400-deep JSON schema, n=64, 100 long
stop strings, 16 stop strings at the documented limit), beside the stream's median gap.

A "victim" thread keeps one streaming completion running back to back; a gap is the time between two
consecutive chunks it receives (see `Victim.gaps`). For each trigger the victim's chunks are recorded from the moment the trigger is sent until
its answer arrives (plus a short tail); the trigger's status and latency are reported too.

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/stall.py --label after \
        [--model /tmp/kv/smol-gpt2] [--out benchmarks/results/stall_after.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from _report import write_report  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server_utils import running_server  # noqa: E402


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def triggers() -> list[tuple[str, bytes]]:
    text_10mb = "hello world, this is a long prompt. " * 290_000  # ~10.4 MB of text
    text_7mb = "hello world, this is a long prompt. " * 200_000  # ~7.2 MB
    schema = deep_schema(400)
    long_stops = [f"{i:03d}" + "zq" * 500 for i in range(100)]  # 100 stops of 1,003 characters
    ok_stops = [f"{i:03d}" + "zq" * 126 for i in range(16)]  # 16 stops of 255 characters
    bodies = {
        "prompt_10MB": {"prompt": text_10mb, "max_tokens": 4},
        "prompt_7MB": {"prompt": text_7mb, "max_tokens": 4},
        "json_schema_depth_400": {
            "prompt": "x",
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "d", "schema": schema},
            },
        },
        "n_64": {"prompt": "Once upon a time", "max_tokens": 16, "n": 64, "ignore_eos": True},
        "stop_100x1000": {
            "prompt": "Tell me",
            "max_tokens": 64,
            "stop": long_stops,
            "ignore_eos": True,
        },  # fmt: skip
        "stop_16x255": {
            "prompt": "Tell me",
            "max_tokens": 64,
            "stop": ok_stops,
            "ignore_eos": True,
        },
    }
    return [(name, json.dumps(body).encode()) for name, body in bodies.items()]


class Victim(threading.Thread):
    """Streams completions back to back; records (stream number, arrival time) of every chunk."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.chunks: list[tuple[int, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"prompt": "Count slowly:", "max_tokens": 128, "ignore_eos": True, "stream": True}
        stream_no = 0
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                stream_no += 1
                with http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            self.chunks.append((stream_no, time.perf_counter()))
                        if self.stop.is_set():
                            break

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between the victim's chunks from the last one before `start` to `end` (a stall still
        going on at `end` counts up to `end`). Across a stream boundary too: a victim request stuck
        before its first chunk is a stall as well (the baseline includes boundaries the same way)."""
        times = [t for _, t in self.chunks]
        before = [t for t in times if t < start]
        inside = [t for t in times if start <= t <= end]
        points = before[-1:] + inside
        gaps = [b - a for a, b in zip(points, points[1:], strict=False)]
        if points:
            gaps.append(end - points[-1])
        return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/kv/smol-gpt2")
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", default=None)
    parser.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument")
    args = parser.parse_args()
    out = args.out or str(ROOT / f"benchmarks/results/stall_{args.label}.json")

    results = []
    serve_args = ("--max-model-len", "1024", *args.server_arg)
    with running_server(args.model, *serve_args, timeout_s=300) as (url, _):
        victim = Victim(url)
        victim.start()
        time.sleep(4.0)  # warm: the victim's steady decode
        baseline_start = time.perf_counter()
        time.sleep(4.0)
        baseline = victim.gaps(baseline_start, time.perf_counter())
        for name, body in triggers():
            sent = time.perf_counter()
            try:
                response = httpx.post(
                    f"{url}/v1/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=300,
                )
                status = response.status_code
            except httpx.HTTPError as exc:
                status = f"error: {type(exc).__name__}"
            answered = time.perf_counter()
            time.sleep(0.5)  # a short tail: a stall that outlasts the answer counts too
            gaps = victim.gaps(sent, time.perf_counter())
            row = {
                "trigger": name,
                "body_bytes": len(body),
                "status": status,
                "trigger_latency_s": round(answered - sent, 3),
                "victim_chunks": len(victim.gaps(sent, time.perf_counter())) - 1,
                "worst_gap_s": round(max(gaps), 4) if gaps else None,
            }
            print(json.dumps(row), flush=True)
            results.append(row)
            time.sleep(1.0)
        victim.stop.set()
        victim.join(60)
    report = {
        "label": args.label,
        "model": args.model,
        "server_args": args.server_arg,
        "baseline_median_gap_s": round(statistics.median(baseline), 4) if baseline else None,
        "baseline_worst_gap_s": round(max(baseline), 4) if baseline else None,
        "triggers": results,
        "command": " ".join(sys.argv),
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
