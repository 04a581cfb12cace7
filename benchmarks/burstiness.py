"""Streaming burstiness under an open-loop load, and the saturation throughput of the serving sweep.

Starts `kvserve serve MODEL`, drives it with the project's own load generator (`kvserve bench serve`,
completions, 128-token prompts, 64 forced output tokens: the sweep's workload in
benchmarks/results/sweep_kvserve), then reads the per-chunk arrival times it recorded
(`requests.jsonl`, `events`):

- burst share: of all gaps between consecutive content chunks of the same stream, the share under
  1 ms (chunks that arrived together although each step produces one token per stream);
- the worst such gap, and the median.

`--saturation` runs a second load at an infinite request rate (the sweep's saturation point) and
reports its request and output-token throughput.

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/burstiness.py --label before \
        [--model kvserve-demo] [--rate 4] [--saturation] [--server-arg=--engine-core=in-process] \
        [--out /tmp/kv/burst.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import write_report  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server_utils import running_server  # noqa: E402

BURST_S = 0.001


def load(url: str, model: str, tokenizer: str, rate: str, num: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url,
           "--endpoint", "completions", "--input-len", "128", "--output-len", "64",
           "--mode", "forced", "--request-rate", rate, "--num-requests", str(num),
           "--warmup", "2", "--tokenizer", tokenizer, "--out", str(out), "--no-plots",
           "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {"command": " ".join(cmd[2:]), "summary": json.loads((out / "summary.json").read_text())}


def burstiness(requests_jsonl: Path) -> dict:
    gaps: list[float] = []
    for line in requests_jsonl.read_text().splitlines():
        record = json.loads(line)
        if record["phase"] != "measured" or record["outcome"] != "ok":
            continue
        times = [e[0] for e in record["events"] if e[1] > 0]  # content chunks only
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "num_gaps": len(gaps),
        "burst_share_under_1ms": round(sum(g < BURST_S for g in gaps) / len(gaps), 4),
        "median_gap_s": round(statistics.median(gaps), 4),
        "worst_gap_s": round(max(gaps), 4),
    }


def throughput(summary: dict) -> dict:
    t = summary["throughput"]
    return {
        "ok": summary["counts"]["ok"],
        "not_ok": summary["counts"]["measured"] - summary["counts"]["ok"],
        "requests_per_s": round(t["requests_per_s"], 4),
        "output_tokens_per_s": round(t["output_tokens_per_s"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kvserve-demo")
    parser.add_argument("--tokenizer", default=None, help="local tokenizer dir (default: model)")
    parser.add_argument("--rate", default="4")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--saturation", action="store_true")
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", default=None)
    parser.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument")
    args = parser.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    out = args.out or str(ROOT / f"benchmarks/results/burstiness_{args.label}.json")
    from kvserve.models import resolve_model

    model_dir = str(resolve_model(args.model))
    report: dict = {"label": args.label, "model": args.model, "server_args": args.server_arg}
    with running_server(args.model, *args.server_arg, timeout_s=300) as (url, _):
        with tempfile.TemporaryDirectory() as tmp:
            run = load(url, args.model, args.tokenizer or model_dir, args.rate,
                       args.num_requests, Path(tmp) / "open")  # fmt: skip
            report["open_loop"] = {
                "rate_rps": args.rate,
                "command": run["command"],
                **burstiness(Path(tmp) / "open" / "requests.jsonl"),
                **throughput(run["summary"]),
            }
            if args.saturation:
                run = load(url, args.model, args.tokenizer or model_dir, "inf",
                           args.num_requests, Path(tmp) / "sat")  # fmt: skip
                report["saturation"] = {"command": run["command"], **throughput(run["summary"])}
    report["command"] = " ".join(sys.argv)
    print(json.dumps(report, indent=1))
    write_report(out, report)


if __name__ == "__main__":
    main()
