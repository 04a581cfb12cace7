"""Validate the simulator against the live server, per metric and load.

1. Calibrate, by default from the server itself (`--calibration server`): load the running
   `kvserve serve` with calibration runs (their own seed, a moderate and a saturating rate), then
   `kvserve simulate --calibrate-server URL` fits the steps the server logged (intake + step +
   streaming per iteration, with residual noise) and the request overhead outside the loop
   (client TTFT - server TTFT of the calibration run). `--calibration offline` times
   `EngineCore.step()` in a separate process instead (`kvserve simulate --calibrate MODEL`).
2. Measure: `kvserve bench serve` (open loop, Poisson, forced lengths) at each rate: a light, a
   medium and a saturating one by default.
3. Predict, twice per rate, with `kvserve simulate --profile`:
   - a priori: the same synthetic workload (same seed, lengths, rate, warm-up, count) before
     looking at the run;
   - replay: the bench run's own `requests.jsonl` (actual send times, the server's token counts).
4. Report predicted vs measured TTFT p50/p99, ITL p50/p99 (chunk level) and output tokens/s,
   with relative errors (predicted / measured - 1), as JSON.

Everything goes through the command line a user would type. On a machine without the embedded demo
model, a random Llama checkpoint with GPT-2's real tokenizer is built (random weights are enough:
the step cost does not depend on the values).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_validation.py --rates 0.5,1.5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._simval_speed import (  # noqa: E402
    at_speed_results,
    measured_intervals,
    print_table,
    replays_at_speed,
    seed_band,
    speed_corrected,
    verdict,
)
from tests.server_utils import free_port  # noqa: E402

METRICS = (
    ("ttft_p50_s", ("latency_s", "ttft", "p50")),
    ("ttft_p99_s", ("latency_s", "ttft", "p99")),
    ("itl_p50_s", ("latency_s", "itl", "p50")),
    ("itl_p99_s", ("latency_s", "itl", "p99")),
    ("e2e_p50_s", ("latency_s", "e2e", "p50")),
    ("output_tokens_per_s", ("throughput", "output_tokens_per_s")),
)


def kvserve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvserve", *args]
    print("+ kvserve " + " ".join(args), flush=True)
    return subprocess.run(cmd, check=True, cwd=ROOT, **kwargs)


def model_dir(args: argparse.Namespace, out: Path) -> Path:
    if args.model:
        return Path(args.model)
    from kvserve.models import ASSETS_DIR

    demo = ASSETS_DIR / "target"
    if (demo / "config.json").is_file():
        return demo
    from tests.checkpoints import build_gpt2_tokenized_checkpoint

    path = out / "model"
    if not (path / "config.json").is_file():
        build_gpt2_tokenized_checkpoint(
            path,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    return path


def start_server(model: Path, engine_args: list[str], port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve", "serve", str(model), "--port", str(port)]
    print("+ kvserve serve " + " ".join([str(model), *engine_args]), flush=True)
    proc = subprocess.Popen(
        cmd + engine_args,
        cwd=ROOT,
        stdout=open(log, "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become ready in 180 s")


def dig(doc: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def compare(predicted: dict, measured: dict) -> dict:
    out = {}
    for name, path in METRICS:
        p, m = dig(predicted, path), dig(measured, path)
        rel = p / m - 1 if isinstance(p, float | int) and isinstance(m, float | int) and m else None
        out[name] = {"predicted": p, "measured": m, "relative_error": rel}
    return out


def server_side(run_dir: Path) -> dict:
    """The server's own means over the run (its /metrics, after minus before): they separate the
    engine loop's time from HTTP delivery and the client."""
    from kvserve.lab.bench.prometheus import delta

    before = (run_dir / "server_metrics_before.prom").read_text()
    after = (run_dir / "server_metrics_after.prom").read_text()
    out = {}
    for name in ("inter_token_latency", "time_to_first_token", "request_queue_time"):
        total = delta(before, after, f"{name}_seconds_sum")
        count = delta(before, after, f"{name}_seconds_count")
        out[f"mean_{name}_s"] = total / count if total is not None and count else None
    return out


def means(summary: dict) -> dict:
    lat = summary["latency_s"]
    return {
        "mean_inter_token_latency_s": lat["itl"]["mean"],
        "mean_time_to_first_token_s": lat["ttft"]["mean"],
        "mean_queue_time_s": lat.get("queue_time", {}).get("mean"),
    }


def simulate(profile: Path, extra: list[str], out: Path, quiet: bool = False) -> dict:
    args = ["simulate", "--profile", str(profile), "--policy", "on_demand-chunked", "--json"]
    args += ["--output", str(out), *extra]
    if quiet:
        subprocess.run([sys.executable, "-m", "kvserve", *args], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    else:
        kvserve(*args, stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    return doc["runs"][0]["summary"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: demo, else a random one)")
    p.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "tmp" / "sim_validation"),
        help="working directory: model, profile, bench runs, simulations, server log",
    )
    p.add_argument(
        "--json",
        default=str(ROOT / "benchmarks" / "results" / "sim_validation.json"),
        help="where the comparison goes",
    )
    p.add_argument("--rates", default="0.5,1.5,inf", help="light, medium, saturating")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--input-len", default="uniform:64:256")
    p.add_argument("--output-len", default="uniform:32:128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--calibrate-budget-s", type=float, default=90.0)
    p.add_argument("--calibration", choices=("server", "offline"), default="server")
    p.add_argument("--quantization", default=None, help="the server's --quantization (a format)")
    p.add_argument("--calibration-rates", default="1,inf", help="server calibration runs")
    p.add_argument("--calibration-requests", type=int, default=30)
    p.add_argument("--noise-seeds", type=int, default=9, help="replays at run speed (spread)")
    args = p.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir(args, out)
    engine_args = [
        "--dtype",
        "float32",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
    ]
    if args.quantization:  # the server and the offline calibration's engine alike
        engine_args += ["--quantization", args.quantization]
    profile = out / "profile.json"
    if args.calibration == "offline":
        calibrate_offline(args, model, profile)
    port = free_port()
    server = start_server(
        model,
        engine_args + ["--max-num-batched-tokens", str(args.max_num_batched_tokens)],
        port,
        out / "server.log",
    )
    workload = [
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        "--num-requests",
        str(args.num_requests),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
    ]
    base_url = f"http://127.0.0.1:{port}"
    results = []
    try:
        if args.calibration == "server":
            calibrate_on_server(args, base_url, out, profile)
        for rate in args.rates.split(","):
            results.append(validate_rate(args, base_url, rate, workload, profile, out))
    finally:
        server.terminate()
        server.wait(timeout=60)
    fit = json.loads(profile.read_text())["fit"]
    doc = {
        "what": "kvserve simulate (calibrated profile, on_demand-chunked = the server's scheduler "
        "settings) vs kvserve bench serve against a live kvserve serve, same workload",
        "model": str(model),
        "calibration": args.calibration,
        "engine": json.loads(profile.read_text())["engine"],
        "calibration_fit": {k: v for k, v in fit.items() if not k.startswith("residual_ratio")}
        | {
            "residual_classes": {
                k: v["num_steps"]
                for k, v in fit.get("residual_ratio_quantiles_by_class", {}).items()
            }
        },  # fmt: skip
        "request_overhead_s": json.loads(profile.read_text()).get("request_overhead_s"),
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_requests": args.num_requests,
            "warmup": args.warmup,
            "arrivals": "poisson",
            "mode": "forced length (ignore_eos, min_tokens = max_tokens), /v1/completions",
            "seed": args.seed,
        },
        "host": {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "quantization": args.quantization,
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print_table(results, METRICS)
    print(f"written to {args.json}")
    return 0


def bench(base_url: str, rate: str, run_dir: Path, workload: list[str]) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    kvserve(
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--endpoint",
        "completions",
        "--mode",
        "forced",
        "--tokenizer",
        "server",
        "--request-rate",
        rate,
        "--out",
        str(run_dir),
        "--no-plots",
        "--no-progress",
        # every rate sends the same seeded prompts; the simulator has no prefix-cache hits,
        # so neither may the server (95% hits at the second rate otherwise)
        "--reset-prefix-cache",
        *workload,
        stdout=subprocess.DEVNULL,
    )
    return json.loads((run_dir / "summary.json").read_text())


def calibrate_on_server(args, base_url: str, out: Path, profile: Path) -> None:
    """Calibration runs with their own seed, then a fit of the steps the server logged."""
    since = httpx.get(f"{base_url}/debug/steps", params={"since": 10**12}).json()["num_recorded"]
    workload = [
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        "--num-requests",
        str(args.calibration_requests),
        "--warmup",
        "2",
        "--seed",
        str(args.seed + 1000),
    ]
    first_run = None
    for rate in args.calibration_rates.split(","):
        run_dir = out / f"calibration_rate_{rate}"
        bench(base_url, rate, run_dir, workload)
        first_run = first_run or run_dir
    steps = out / "server_steps.json"  # kept: what the fit saw
    steps.write_text(
        json.dumps(httpx.get(f"{base_url}/debug/steps", params={"since": since}).json())
    )
    kvserve(
        "simulate",
        "--calibrate-server",
        str(steps),
        "--calibrate-run",
        str(first_run),
        "--save",
        str(profile),
        "--accept-poor-fit",  # a poor fit is reported in the JSON, not fatal to the benchmark
    )


def validate_rate(args, base_url: str, rate: str, workload: list[str], profile: Path, out: Path):
    run_dir = out / f"bench_rate_{rate}"
    since = httpx.get(f"{base_url}/debug/steps", params={"since": 10**12}).json()["num_recorded"]
    measured = bench(base_url, rate, run_dir, workload)
    # the steps the server ran for this rate: the machine's speed during the run
    steps = out / f"server_steps_rate_{rate}.json"
    steps.write_text(
        json.dumps(httpx.get(f"{base_url}/debug/steps", params={"since": since}).json())
    )
    speed, at_speed, at_one = speed_corrected(profile, steps, out, rate)
    trace = run_dir / "requests.jsonl"
    runs, one_runs = replays_at_speed(
        at_speed, at_one, trace, out, rate, args.noise_seeds, simulate
    )
    a_priori = simulate(
        profile, workload + ["--request-rate", rate], out / f"sim_a_priori_{rate}.json"
    )
    replay = simulate(
        profile, ["--trace", str(run_dir / "requests.jsonl")], out / f"sim_replay_{rate}.json"
    )
    from kvserve.lab.bench.records import read_jsonl

    replays = at_speed_results(runs, one_runs, measured, METRICS, dig, compare)
    at_speed_cmp = replays["replay_at_run_speed"]
    band = seed_band(runs, METRICS, dig)
    interval = measured_intervals(read_jsonl(run_dir / "requests.jsonl"))
    return {
        "rate": float(rate),
        "measured_realised_rate_rps": dig(measured, ("arrivals", "realised_rate_rps")),
        "mean_tokens_per_chunk": dig(measured, ("tokens_per_chunk", "mean_tokens_per_chunk")),
        "a_priori": compare(a_priori, measured),
        "replay": compare(replay, measured),
        "speed": speed,
        **replays,
        "seed_band": band,
        "measured_interval": interval,
        "verdict_at_run_speed": {
            name: verdict(
                at_speed_cmp[name]["relative_error"],
                interval.get(name),
                band[name],
                at_speed_cmp[name]["measured"],
            )
            for name, _ in METRICS
        },
        "measured_counts": measured.get("counts"),
        "means": {
            "measured_client": means(measured),
            "measured_server": server_side(run_dir),
            "replay": means(replay),
        },
    }


def calibrate_offline(args, model: Path, profile: Path) -> None:
    kvserve(
        "simulate",
        "--calibrate",
        str(model),
        "--save",
        str(profile),
        "--calibrate-budget-s",
        str(args.calibrate_budget_s),
        "--calibrate-max-len",
        "512",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--chunk-tokens",
        str(args.max_num_batched_tokens),
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        "float32",
        *(["--quantization", args.quantization] if args.quantization else []),
    )


if __name__ == "__main__":
    sys.exit(main())
