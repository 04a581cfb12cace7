"""Cross-check `kvserve bench serve` against an independent load tool (GuideLLM) on one server.

One `kvserve serve` process, warmed by a few requests of neither tool (`--server-warmup`: the
first requests a server sees take its cold paths, and landed in the first tool's TTFT p99); the
two tools take turns, A B B A A B ... (GuideLLM, kvserve, kvserve, GuideLLM, ...: neither always
goes first), at the same constant rate with the same prompt and forced output lengths, no
warm-up requests on either side, the server's prefix cache reset before every run (GuideLLM sends
the same prompts each time; `kvserve bench serve --reset-prefix-cache`). Every number is
recomputed from each tool's raw per-request timings with one set of definitions
(kvserve.lab.bench.crosscheck: TTFT; decode time per token = kvserve's TPOT = GuideLLM's ITL; output
tok/s over the run), and each tool's own headline numbers are kept beside them. The spread is the min..max over a tool's runs.

Run under the exclusive CPU lock (it is a timing):

    kv-bench .venv/bin/python benchmarks/bench_crosscheck.py --rounds 2

GuideLLM lives in its own venv (its pins differ from kvserve's): pass --guidellm PATH or set
KVSERVE_GUIDELLM (default /tmp/kv/guidellm-venv/bin/guidellm).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_validation import start_server  # noqa: E402
from kvserve.lab.bench.client import reset_prefix_cache  # noqa: E402
from kvserve.lab.bench.crosscheck import (  # noqa: E402
    guidellm_reported,
    kvserve_reported,
    mapped_metrics,
    timings_from_guidellm,
    timings_from_kvserve,
)
from kvserve.lab.bench.records import read_jsonl  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

COMPARED = (
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p99_s", "TTFT p99"),
    ("decode_per_token_p50_s", "TPOT=GuideLLM ITL p50"),
    ("decode_per_token_p99_s", "TPOT=GuideLLM ITL p99"),
    ("output_tokens_per_s", "output tok/s"),
)


def run_guidellm(exe: str, base_url: str, model_dir: Path, args, out: Path) -> dict:
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base_url,
                "request_format": "/v1/completions",
            },
            "profile": {"kind": "constant", "rate": args.rate},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.input_len,
                    "output_tokens": args.output_len,
                }
            ],
            "constraints": [{"kind": "max_requests", "count": args.num_requests}],
        }
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenario.json").write_text(json.dumps(scenario, indent=1))
    # GuideLLM sends the same synthetic prompts every run: without this, a run right after its
    # own previous one hit the prefix cache (TTFT p50 12 ms against 40)
    reset = reset_prefix_cache(base_url, {})
    if reset["status"] != "ok":
        raise RuntimeError(f"could not reset the server's prefix cache: {reset}")
    cmd = [
        exe, "run", "--scenario", str(out / "scenario.json"),
        "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
        "--output", f"kind=json,path={out / 'guidellm.json'}",
        "--disable-progress",
    ]  # fmt: skip
    print("+ " + " ".join(cmd), flush=True)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(out / "guidellm.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=out, stdout=log, stderr=subprocess.STDOUT, env=env)
    doc = json.loads((out / "guidellm.json").read_text())
    bench = doc["benchmarks"][0]
    server = [
        (r.get("response_metrics") or {}).get("ttft_s") for r in bench["requests"]["successful"]
    ]
    return {
        "mapped": mapped_metrics(timings_from_guidellm(bench)),
        "reported": guidellm_reported(bench),
        "server_ttft_s": server_percentiles(server),
        "num_errored": len(bench["requests"].get("errored", [])),
    }


def warm_server(base_url: str, num_requests: int, max_tokens: int) -> None:
    """`num_requests` completions, one after another, before either tool's first run."""
    import httpx

    with httpx.Client(base_url=base_url, timeout=300.0) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(num_requests):
            body = {"model": model, "prompt": f"warm-up {i}: " + "hello " * 64,
                    "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
            client.post("/v1/completions", json=body).raise_for_status()


def run_kvserve(base_url: str, model_dir: Path, args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "constant.txt"  # GuideLLM's constant profile: evenly spaced sends
    trace.write_text("".join(f"{i / args.rate:.6f}\n" for i in range(args.num_requests)))
    cmd = [
        sys.executable, "-m", "kvserve", "bench", "serve", "--base-url", base_url,
        "--endpoint", "completions", "--mode", "forced", "--tokenizer", str(model_dir),
        "--trace", str(trace), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--num-requests", str(args.num_requests),
        "--warmup", "0", "--out", str(out / "run"), "--no-plots", "--no-progress",
        "--reset-prefix-cache",
    ]  # fmt: skip
    print("+ kvserve " + " ".join(cmd[3:]), flush=True)
    with open(out / "bench.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    summary = json.loads((out / "run" / "summary.json").read_text())
    records = read_jsonl(out / "run" / "requests.jsonl")
    server = [(r.extra or {}).get("server_metrics", {}).get("ttft_s") for r in records]
    return {
        "mapped": mapped_metrics(timings_from_kvserve(records)),
        "reported": kvserve_reported(summary),
        "server_ttft_s": server_percentiles(server),
        "num_failed": summary.get("counts", {}).get("failed"),
    }


def server_percentiles(values: list) -> dict:
    """The server's own TTFT (kvserve's per-request metrics) under this tool's load: a tool that
    loads the shared CPU more slows the server itself, which no definition explains."""
    import numpy as np

    v = [float(x) for x in values if x is not None]
    return {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))} if v else {}


def spread(runs: list[dict], key: str) -> dict:
    values = [r["mapped"][key] for r in runs if r["mapped"].get(key) is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: the demo model)")
    p.add_argument("--guidellm", default=os.environ.get("KVSERVE_GUIDELLM"))
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="pairs: A B, then B A, ...")
    p.add_argument(
        "--server-warmup", type=int, default=4, help="requests to the server before the first run"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tmp" / "crosscheck"))
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "bench_crosscheck.json"))
    args = p.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    exe = args.guidellm or "/tmp/kv/guidellm-venv/bin/guidellm"
    if not Path(exe).is_file():
        print(f"GuideLLM not found at {exe}: pip install guidellm in its own venv", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.model:
        model_dir = Path(args.model)
    else:
        from kvserve.models import default_model_dir

        model_dir = default_model_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(model_dir, ["--dtype", "float32"], port, out / "server.log")
    runs: dict[str, list[dict]] = {"guidellm": [], "kvserve": []}
    try:
        warm_server(base_url, args.server_warmup, args.output_len)
        for i in range(args.rounds):
            order = ("guidellm", "kvserve") if i % 2 == 0 else ("kvserve", "guidellm")
            for tool in order:  # A B, then B A
                if tool == "guidellm":
                    runs[tool].append(run_guidellm(exe, base_url, model_dir, args, out / f"A{i}"))
                else:
                    runs[tool].append(run_kvserve(base_url, model_dir, args, out / f"B{i}"))
    finally:
        server.terminate()
        server.wait(timeout=60)
    table = []
    for key, label in COMPARED:
        g, k = spread(runs["guidellm"], key), spread(runs["kvserve"], key)
        rel = k["mean"] / g["mean"] - 1 if g["mean"] and k["mean"] is not None else None
        overlap = None
        if g["min"] is not None and k["min"] is not None:
            overlap = k["min"] <= g["max"] and g["min"] <= k["max"]
        ok = rel is not None and (abs(rel) <= 0.05 or bool(overlap))
        table.append({"metric": key, "label": label, "guidellm": g, "kvserve": k,
                      "kvserve_vs_guidellm": rel, "ranges_overlap": overlap,
                      "within_5pct_or_spread": ok})  # fmt: skip
    doc = {
        "what": "kvserve bench serve vs GuideLLM on one kvserve server, A B A B",
        "model": str(model_dir),
        "workload": {
            "rate_rps": args.rate,
            "arrivals": "constant",
            "num_requests": args.num_requests,
            "input_tokens": args.input_len,
            "output_tokens": args.output_len,
            "mode": "forced (ignore_eos)",
            "warmup_requests": 0,
            "server_warmup_requests": args.server_warmup,
            "order": "A B, then B A, per round",
        },  # fmt: skip
        "definitions": sys.modules["kvserve.lab.bench.crosscheck"].__doc__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "table": table,
        "runs": runs,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print_table(table)
    print(f"written to {args.json}")
    return 0


def _v(x: float | None, key: str) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if key == "output_tokens_per_s" else f"{x * 1e3:.1f}ms"


def print_table(table: list[dict]) -> None:
    print(f"{'metric':<24} {'GuideLLM (min..max)':>26} {'kvserve (min..max)':>26} {'diff':>7}")
    for row in table:
        key = row["metric"]
        cells = []
        for tool in ("guidellm", "kvserve"):
            s = row[tool]
            cells.append(f"{_v(s['mean'], key)} ({_v(s['min'], key)}..{_v(s['max'], key)})")
        rel = row["kvserve_vs_guidellm"]
        print(f"{row['label']:<24} {cells[0]:>26} {cells[1]:>26} "
              f"{'-' if rel is None else f'{rel:+.1%}':>7}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
