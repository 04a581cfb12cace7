"""`kvserve bench`: `serve` (HTTP load test of any OpenAI-compatible server) and `compare` (two
runs).

`kvserve bench latency` (offline, in-process) is registered by `kvserve.lab.bench.latency` when that
module exists: it defines `register(bench_subparsers)`, like the modules of kvserve.cli.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from kvserve.options import HelpFormatter

SERVE_EPILOG = """\
examples:
  kvserve bench serve --base-url http://127.0.0.1:8000 --num-requests 200 --request-rate 4 \\
      --input-len lognormal:512:0.6:16:2048 --output-len 128 --slo ttft=3s,worst_gap=100ms
  kvserve bench serve --mode forced --input-len 32 --output-len 256 --max-concurrency 16 \\
      --num-requests 128
  kvserve bench serve --sweep 1,2,4,8,inf --num-requests 100 --reset-prefix-cache \\
      --slo p99_ttft=2s,p99_itl=100ms
  kvserve bench serve --find-capacity --duration 60 --slo ttft=2s,worst_gap=200ms \\
      --min-attainment 0.95

length distributions: N | fixed:N | uniform:LOW:HIGH | lognormal:MEDIAN:SIGMA[:LOW:HIGH] (clipped)
objectives (--slo, repeatable, one named set each): per request
  ttft|tpot|e2e|worst_gap|queue_time=LIMIT, or pooled percentiles
  pNN_<ttft|tpot|itl|itl_token|e2e|worst_gap|queue_time>=LIMIT; LIMIT like 3s, 100ms
"""


# `bench serve` with no size flags: a short, finite run at a stated rate (issue 46), not an error
DEFAULT_NUM_REQUESTS = 32
DEFAULT_REQUEST_RATE = 1.0  # requests/s, Poisson


def _rate(text: str) -> float:
    value = float(text)  # accepts "inf"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or inf, got {text}")
    return value


def _rates(text: str) -> tuple[float, ...]:
    return tuple(_rate(t) for t in text.split(",") if t.strip())


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label takes KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _add_serve(sub) -> None:
    """Long: the `bench serve` flags, one declaration each, in help order. A default the run's
    configuration also has (`ClientConfig`, `WorkloadSpec`, `ArrivalSpec`, `ServeConfig`) is read
    from it, not written again."""
    from kvserve.lab.bench.arrivals import ArrivalSpec
    from kvserve.lab.bench.client import ClientConfig
    from kvserve.lab.bench.runner import ServeConfig
    from kvserve.lab.bench.workloads import WorkloadSpec

    p = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server over HTTP",
        epilog=SERVE_EPILOG,
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)"
    )
    g.add_argument("--model", default=None, help="model name (default: the first in /v1/models)")
    g.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default=ClientConfig.endpoint,
        help="/v1/chat/completions (the chat template wraps each prompt) or /v1/completions",
    )
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument(
        "--timeout",
        type=float,
        default=ClientConfig.timeout_s,
        help="per-request budget in seconds",
    )
    g.add_argument(
        "--temperature", type=float, default=ClientConfig.temperature, help="sampling temperature"
    )
    g.add_argument(
        "--extra-body",
        default=ClientConfig.extra_body,
        help="JSON object merged into every request body",
    )
    g.add_argument(
        "--per-chunk-usage",
        action=argparse.BooleanOptionalAction,
        default=ClientConfig.per_chunk_usage,
        help="ask for usage in every chunk (vLLM continuous_usage_stats) to count tokens per chunk",
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=("random", "sharegpt", "shared-prefix"),
        default=WorkloadSpec.kind,
        help="synthetic prompts, a ShareGPT file, or prompts sharing --num-prefixes prefixes",
    )
    g.add_argument(
        "--input-len", default="512", help="prompt tokens (shared-prefix: suffix tokens)"
    )
    g.add_argument(
        "--output-len",
        default=None,
        help="max_tokens distribution (default 128; sharegpt: reference reply)",
    )
    g.add_argument(
        "--content",
        choices=("prose", "code"),
        default=WorkloadSpec.content,
        help="synthetic text: prose is hard to predict, code easy (matters for speculative "
        "decoding)",
    )
    g.add_argument("--dataset", default=None, help="ShareGPT-format JSON file (sharegpt workload)")
    g.add_argument(
        "--prefix-len",
        type=int,
        default=WorkloadSpec.prefix_len,
        help="shared-prefix: tokens of the common prefix",
    )
    g.add_argument(
        "--num-prefixes",
        type=int,
        default=WorkloadSpec.num_prefixes,
        help="shared-prefix: number of distinct prefixes",
    )
    g.add_argument(
        "--tokenizer",
        default=ServeConfig.tokenizer,
        help="auto (server /tokenize, else approximate) | server | approx | a local tokenizer dir",
    )
    g.add_argument(
        "--mode",
        choices=("natural", "forced"),
        default=ClientConfig.mode,
        help="natural stop, or forced length (ignore_eos + min_tokens = max_tokens)",
    )
    g = p.add_argument_group("arrivals and size")
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=None,
        help="open loop requests/s, or inf (the default with --num-requests or --duration)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=ArrivalSpec.burstiness,
        help="gamma shape of the gaps (1 = Poisson)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="closed loop users (without --request-rate), or a cap on an open loop",
    )
    g.add_argument("--trace", default=None, help="arrival trace: seconds per line, or JSON lines")
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"measured requests (with neither this nor --duration: {DEFAULT_NUM_REQUESTS}, at "
        f"{DEFAULT_REQUEST_RATE:g} request/s unless a rate, a concurrency or --sweep is given)",
    )
    g.add_argument("--duration", type=float, default=None, help="seconds of measured arrivals")
    g.add_argument(
        "--warmup",
        type=int,
        default=ServeConfig.num_warmup,
        help="warm-up requests (labelled, excluded)",
    )
    g.add_argument(
        "--seed", type=int, default=ServeConfig.seed, help="seed of lengths, texts and arrivals"
    )
    g = p.add_argument_group("objectives and searches")
    g.add_argument("--slo", action="append", default=[], help="named objective set (see below)")
    g.add_argument(
        "--min-attainment",
        type=float,
        default=ServeConfig.min_attainment,
        help="per-request objectives: fraction of requests that must meet them to pass",
    )
    g.add_argument(
        "--prefill-speed",
        type=float,
        default=None,
        help="measured prefill tokens/s for the wall-clock decomposition (default: estimated)",
    )
    g.add_argument(
        "--sweep", type=_rates, default=None, help="comma-separated rates, e.g. 1,2,4,inf"
    )
    g.add_argument(
        "--find-capacity", action="store_true", help="search the highest rate meeting --slo"
    )
    g.add_argument(
        "--capacity-start",
        type=_rate,
        default=ServeConfig.capacity_start_rps,
        help="first rate of the search, req/s",
    )
    g.add_argument(
        "--capacity-max",
        type=_rate,
        default=ServeConfig.capacity_max_rps,
        help="highest rate tried, req/s",
    )
    g.add_argument(
        "--capacity-tol",
        type=float,
        default=ServeConfig.capacity_rel_tol,
        help="relative width to stop bisecting",
    )
    g.add_argument(
        "--capacity-max-trials",
        type=int,
        default=ServeConfig.capacity_max_trials,
        help="most runs the search makes",
    )
    g.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="POST /reset_prefix_cache before each run (every sweep rate, every capacity trial) so "
        "that no run is served from the previous one's cache; warns when the server lacks it",
    )
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="output directory (default runs/bench-<time>)")
    g.add_argument(
        "--label",
        type=_label,
        action="append",
        default=[],
        help="KEY=VALUE metadata, e.g. hardware=H100 dtype=bf16 (wins over the server's)",
    )
    g.add_argument(
        "--save-outputs", action="store_true", help="also write outputs.jsonl (the texts)"
    )
    g.add_argument(
        "--plots",
        action=argparse.BooleanOptionalAction,
        default=ServeConfig.plots,
        help="embed plots in report.html (matplotlib)",
    )
    g.add_argument(
        "--retokenize",
        action=argparse.BooleanOptionalAction,
        default=ServeConfig.retokenize,
        help="count output tokens again with the tokenizer to check the server's usage",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    p.set_defaults(func=_serve_main)


def _default_run(args: argparse.Namespace) -> str | None:
    """Fills in the short default run when neither --num-requests nor --duration is given (a trace
    sets its own length; a capacity search needs --duration); returns the line that says so."""
    if (
        args.num_requests is not None
        or args.duration is not None
        or args.trace
        or args.find_capacity
    ):
        return None
    args.num_requests = DEFAULT_NUM_REQUESTS
    said = f"{DEFAULT_NUM_REQUESTS} requests"
    if args.request_rate is None and not args.max_concurrency and not args.sweep:
        args.request_rate = DEFAULT_REQUEST_RATE
        said += f" at {DEFAULT_REQUEST_RATE:g} request/s (Poisson)"
    return f"no --num-requests or --duration: {said}"


def _serve_config(args: argparse.Namespace):
    from kvserve.lab.bench.arrivals import ArrivalSpec
    from kvserve.lab.bench.client import ClientConfig, normalise_base_url
    from kvserve.lab.bench.runner import ServeConfig
    from kvserve.lab.bench.slo import ObjectiveSet
    from kvserve.lab.bench.workloads import LengthDist, WorkloadSpec

    client = ClientConfig(
        base_url=normalise_base_url(args.base_url),
        model=args.model or "",
        endpoint=args.endpoint,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        mode=args.mode,
        temperature=args.temperature,
        timeout_s=args.timeout,
        per_chunk_usage=args.per_chunk_usage,
        extra_body=args.extra_body,
    )
    output_len = args.output_len or (None if args.workload == "sharegpt" else "128")
    workload = WorkloadSpec(
        kind=args.workload,
        input_len=LengthDist.parse(args.input_len),
        output_len=LengthDist.parse(output_len) if output_len else None,
        content=args.content,
        seed=args.seed,
        dataset=args.dataset,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
    )
    if args.trace:
        arrivals = ArrivalSpec("trace", max_concurrency=args.max_concurrency, trace_path=args.trace)
    elif (
        args.request_rate is None
        and args.max_concurrency
        and not (args.sweep or args.find_capacity)
    ):
        arrivals = ArrivalSpec("closed", max_concurrency=args.max_concurrency)
    else:  # open loop; a sweep or a capacity search replaces the rate
        arrivals = ArrivalSpec("inf", None, args.burstiness, args.max_concurrency)
        arrivals = arrivals.with_rate(args.request_rate or float("inf"))
    out = args.out or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    return ServeConfig(
        client=client,
        workload=workload,
        arrivals=arrivals,
        out_dir=out,
        num_requests=args.num_requests,
        duration_s=args.duration,
        num_warmup=args.warmup,
        seed=args.seed,
        tokenizer=args.tokenizer,
        objective_sets=tuple(ObjectiveSet.parse(s) for s in args.slo),
        min_attainment=args.min_attainment,
        prefill_tok_s=args.prefill_speed,
        labels=tuple(args.label),
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
        plots=args.plots,
        save_outputs=args.save_outputs,
        retokenize=args.retokenize,
        sweep_rates=args.sweep or (),
        find_capacity=args.find_capacity,
        capacity_start_rps=args.capacity_start,
        capacity_max_rps=args.capacity_max,
        capacity_rel_tol=args.capacity_tol,
        capacity_max_trials=args.capacity_max_trials,
        reset_prefix_cache=args.reset_prefix_cache,
        command=tuple(sys.argv),
    )


def _serve_main(args: argparse.Namespace) -> int:
    from kvserve.lab.bench.records import BenchError
    from kvserve.lab.bench.session import run_serve

    try:
        if (said := _default_run(args)) is not None:
            print(f"kvserve bench serve: {said}", flush=True)
        return run_serve(_serve_config(args))
    except BenchError as exc:
        print(f"kvserve bench serve: error: {exc}", file=sys.stderr)
        return 2


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="metric deltas and output identity of two bench runs")
    p.add_argument("run_a", help="run directory (summary.json + requests.jsonl)")
    p.add_argument("run_b", help="the run directory to compare against run_a")
    p.add_argument("--json", default=None, help="also write the comparison to this JSON file")
    p.add_argument(
        "--require-identical",
        action="store_true",
        help="exit 1 unless every measured request's output is identical",
    )
    p.set_defaults(func=_compare_main)


def _compare_main(args: argparse.Namespace) -> int:
    import json

    from kvserve.lab.bench.compare import compare_runs, format_comparison
    from kvserve.lab.bench.records import BenchError
    from kvserve.lab.bench.summary import json_safe

    try:
        doc = compare_runs(args.run_a, args.run_b)
    except BenchError as exc:
        print(f"kvserve bench compare: error: {exc}", file=sys.stderr)
        return 2
    print(format_comparison(doc))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_safe(doc), f, indent=1)
    return 1 if args.require_identical and not doc["outputs"]["all_identical"] else 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks: HTTP load tests and run comparisons")
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    _add_serve(sub)
    _add_compare(sub)
    try:  # `bench latency` lives in its own module, written separately
        latency = importlib.import_module("kvserve.lab.bench.latency")
    except ModuleNotFoundError as exc:
        if exc.name != "kvserve.lab.bench.latency":
            raise
    else:
        latency.register(sub)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
