"""Memory that returns (issue 46 item 5): the API process's and the engine core's RSS after warm-up,
after a hostile load, and after the same load again.

The load: requests with 300 distinct JSON schemas (the engine's compiled-grammar cache), ten requests at
the per-request sample bound (16 prompts x n=16), 200 hostile bodies (bad JSON, wrong types, oversized
stops, lone surrogates, unknown fields) and 60 streams dropped mid-flight. RSS is read from /proc after
the server is idle again. A leak grows with every round; a bounded cache grows once and stays.

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/rss_after_load.py \
        --out benchmarks/results/zen3_avx2/rss_after_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = httpx.get(f"{url}/ready").json()
        if ready.get("num_running") == 0 and ready.get("num_unfinished") == 0:
            time.sleep(2.0)  # let freed buffers settle
            return
        time.sleep(0.2)
    raise RuntimeError("the server did not go idle")


def schema(i: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"},
            f"name_{i % 7}": {"type": "string", "maxLength": 8 + i % 5}},
            "required": [f"field_{i}"]}  # fmt: skip


HOSTILE = [
    b"{", b"[]", b'{"prompt": 5}', b'{"prompt": "hi", "max_tokens": -1}',
    b'{"prompt": "hi", "stop": ["' + b"x" * 300 + b'"]}', b'{"prompt": "\\ud800"}',
    b'{"prompt": "hi", "n": 99}', b'{"prompt": "hi", "temperature": "hot"}',
    b'{"messages": "no"}', b'{"prompt": "hi", "logit_bias": {"999999999": 5}}',
]  # fmt: skip


async def load(url: str, round_index: int) -> dict:
    counts = {"schema": 0, "samples": 0, "hostile": 0, "dropped": 0}
    limits = httpx.Limits(max_connections=80)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sem = asyncio.Semaphore(8)

        async def post(path, **kw):
            async with sem:
                return await client.post(f"{url}{path}", **kw)

        jobs = []
        for i in range(300):
            body = {"messages": [{"role": "user", "content": f"Give record {i} as JSON."}],
                    "max_tokens": 24, "response_format": {"type": "json_schema", "json_schema": {
                        "name": f"r{i}", "schema": schema(1000 * round_index + i)}}}  # fmt: skip
            jobs.append(post("/v1/chat/completions", json=body))
        for _ in range(10):
            jobs.append(post("/v1/completions",
                             json={"prompt": ["hi"] * 16, "n": 16, "max_tokens": 8}))  # fmt: skip
        for i in range(200):
            jobs.append(post("/v1/completions", content=HOSTILE[i % len(HOSTILE)],
                             headers={"content-type": "application/json"}))  # fmt: skip
        results = await asyncio.gather(*jobs)
        counts["schema"] = sum(r.status_code == 200 for r in results[:300])
        counts["samples"] = sum(r.status_code == 200 for r in results[300:310])
        counts["hostile"] = sum(400 <= r.status_code < 500 for r in results[310:])

        async def dropped(i):
            body = {"prompt": f"story {i}", "max_tokens": 200, "stream": True, "ignore_eos": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        return 1
            return 0

        counts["dropped"] = sum(await asyncio.gather(*(dropped(i) for i in range(60))))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", args.model, "--host", "127.0.0.1", "--port",
         str(port), "--log-level", "warning"],
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.5)
        engine_pid = httpx.get(f"{url}/ready").json()["engines"][0]["pid"]
        pids = {"api": server.pid, "engine": engine_pid}
        for i in range(20):  # warm-up: every path once or more
            httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "w", "schema": schema(-1 - i % 3)}}})  # fmt: skip
            httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"prompt": "warm", "max_tokens": 8, "n": 2})  # fmt: skip
        wait_idle(url)
        rows = [{"phase": "after warm-up"} | {k: rss_mib(p) for k, p in pids.items()}]
        for r in range(args.rounds):
            counts = asyncio.run(load(url, r))
            wait_idle(url)
            rows.append({"phase": f"after load round {r + 1}", "counts": counts}
                        | {k: rss_mib(p) for k, p in pids.items()})  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr)
        debug = httpx.get(f"{url}/debug/engine").json()
    finally:
        server.terminate()
        server.wait(30)
    base = rows[0]
    print(f"{'phase':24s} {'API MiB':>9s} {'engine MiB':>11s} {'API x':>7s} {'engine x':>9s}")
    for row in rows:
        print(f"{row['phase']:24s} {row['api']:9.1f} {row['engine']:11.1f} "
              f"{row['api'] / base['api']:7.3f} {row['engine'] / base['engine']:9.3f}")  # fmt: skip
    print(f"blocks free after: {debug['num_free_blocks']} of {debug['num_blocks']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "rows": rows, "debug": debug},
                                       indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
