"""`kvserve simulate`: what-if serving runs on the engine's own scheduler and KV manager, timed by a
roofline or by a profile calibrated on the real engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.cli.plan import add_assumption_arguments, add_device_arguments, add_format_arguments
from kvserve.cli.simulate_inputs import (
    engine_shape_from_args,
    hardware_from_args,
    workload_source_from_args,
)
from kvserve.config import SchedulerConfig

DEFAULT_POLICIES = "static,reserve,on_demand,on_demand-chunked"

EPILOG = """\
examples:
  kvserve simulate Llama-3.1-8B --hardware h100-sxm --request-rate 0.5,1,2,4 \\
      --input-len uniform:2000:6000 --output-len lognormal:1500:0.5:16:4000 --plot rates.png
  kvserve simulate Llama-3.1-8B --policy on_demand-chunked --find-capacity \\
      --slo ttft=3s,worst_gap=200ms --price-per-hour 3
  kvserve simulate --calibrate ./my-model --save profile.json       # time the real engine, fit
  kvserve simulate --profile profile.json --trace runs/bench-X/requests.jsonl \\
      --policy on_demand-chunked                                     # replay a bench run

policies: static | reserve | on_demand | reserve-chunked | on_demand-chunked (docs/scheduling.md).
  -chunked: at most --chunk-tokens new tokens per step; otherwise max_model_len + max_num_seqs.
lengths: N | uniform:LOW:HIGH | lognormal:MEDIAN:SIGMA[:LOW:HIGH]   (as kvserve bench serve)
objectives (--slo): ttft|tpot|e2e|worst_gap|queue_time=LIMIT per request, or pNN_<metric>=LIMIT
"""


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(t) for t in text.split(",") if t.strip())
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 or inf, got {text!r}")
    return rates


def register(subparsers: Any) -> None:
    """Long: the `simulate` flags, one declaration each, in help order."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate serving policies on the engine's scheduler with a cost model",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="preset, HF model directory or config.json (roofline)")
    g = p.add_argument_group("cost model: roofline (default) or a calibrated profile")
    g.add_argument("--hardware", default=None, help="built-in profile, this-machine or JSON")
    add_device_arguments(g)
    add_format_arguments(g)
    add_assumption_arguments(g)
    g.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed cost per step (0)")
    g.add_argument("--profile", metavar="PATH", help="calibrated step profile (JSON)")
    g = p.add_argument_group("calibrate on the real engine")
    g.add_argument("--calibrate", metavar="MODEL_DIR", help="time engine steps, fit a profile")
    g.add_argument("--save", metavar="PATH", default="step-profile.json", help="profile output")
    g.add_argument("--device", default="cpu", help="torch device for calibration (cpu)")
    g.add_argument("--dtype", default="auto", help="engine dtype for calibration (auto)")
    g.add_argument(
        "--quantization",
        metavar="FMT",
        default=None,
        help="the engine's --quantization for --calibrate: a quantised engine times its own "
        "steps (docs/quantization.md)",
    )
    g.add_argument(
        "--calibrate-max-len", type=int, default=1024, help="longest context calibrated (1024)"
    )
    g.add_argument(
        "--calibrate-budget-s", type=float, default=120.0, help="time for the sweep (120 s)"
    )
    g.add_argument(
        "--calibrate-server",
        metavar="URL|FILE",
        help="fit the steps a live kvserve server logged (GET /debug/steps), or a saved copy",
    )
    g.add_argument("--steps-since", type=int, default=0, help="first step index to fit (0)")
    g.add_argument(
        "--calibrate-run",
        metavar="RUN_DIR",
        help="a bench run against that server: its client-server TTFT gap is the request overhead",
    )
    g.add_argument(
        "--max-fit-error",
        type=float,
        default=0.30,
        help="refuse a fit whose median |measured/predicted - 1| exceeds this (0.30)",
    )
    g.add_argument(
        "--max-fit-p90-error",
        type=float,
        default=0.75,
        help="refuse a fit whose p90 |measured/predicted - 1| exceeds this (0.75)",
    )
    g.add_argument(
        "--accept-poor-fit",
        action="store_true",
        help="save a fit worse than the bounds anyway (marked poor, with a warning)",
    )
    g.add_argument(
        "--step-noise",
        choices=("residuals", "pooled", "off"),
        default="residuals",
        help="per-step cost noise drawn from the profile's fit residuals: per step class and "
        "correlated in time as measured (residuals), all steps alike and independent (pooled)",
    )
    g = p.add_argument_group("engine limits")
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"running sequences ({SchedulerConfig.max_num_seqs})",
    )
    g.add_argument(
        "--chunk-tokens", type=int, default=None, help="token budget of -chunked policies (512)"
    )
    g.add_argument("--block-size", type=int, default=None, help="KV block size (16)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: memory)")
    g.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache size instead")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit")
    g.add_argument("--no-prefix-caching", action="store_true", help="simulate without it")
    g.add_argument("--static-batch-size", type=int, default=None, help="(max-num-seqs)")
    g.add_argument("--static-timeout", default="1s", help="static dispatch timeout (1s)")
    g.add_argument("--policy", default=DEFAULT_POLICIES, help=f"({DEFAULT_POLICIES})")
    g = p.add_argument_group("speculative decoding (continuous policies)")
    g.add_argument("--speculative-k", type=int, default=0, help="proposals per step (0: off)")
    g.add_argument("--acceptance", type=float, default=0.7, help="per-proposal acceptance (0.7)")
    g.add_argument("--draft-step-ms", type=float, default=0.0, help="draft forward per position")
    g.add_argument("--draft-token-ms", type=float, default=0.0, help="draft cost per proposal")
    g = p.add_argument_group("workload")
    # defaults that fit the default model's 8,192-token context (issue 46): at most 3,000 + 2,000
    g.add_argument("--input-len", default="uniform:500:3000", help="prompt tokens")
    g.add_argument("--output-len", default="lognormal:500:0.5:16:2000", help="output tokens")
    g.add_argument("--num-requests", type=int, default=200, help="measured requests (200)")
    g.add_argument("--warmup", type=int, default=0, help="warm-up requests, excluded (0)")
    g.add_argument(
        "--request-rate",
        type=_rates,
        default=None,
        help="rates, e.g. 0.5,1,2,inf (1; a trace: its own)",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    g.add_argument("--seed", type=int, default=0, help="seed of lengths and arrivals")
    g.add_argument("--trace", default=None, help="bench requests.jsonl or an arrival trace")
    g = p.add_argument_group("objectives, capacity, cost")
    g.add_argument("--slo", action="append", default=[], help="named objective set")
    g.add_argument(
        "--min-attainment", type=float, default=0.9, help="share of requests meeting --slo"
    )
    g.add_argument("--find-capacity", action="store_true", help="highest rate meeting --slo")
    g.add_argument("--capacity-start", type=float, default=1.0, help="first rate tried, req/s")
    g.add_argument("--capacity-max", type=float, default=1024.0, help="highest rate, req/s")
    g.add_argument("--capacity-tol", type=float, default=0.05, help="relative rate tolerance")
    g.add_argument("--capacity-max-trials", type=int, default=16, help="search trials at most")
    g.add_argument("--price-per-hour", type=float, default=None, help="USD per device-hour")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")
    g.add_argument("--output", metavar="FILE", help="also write the JSON here")
    g.add_argument("--plot", metavar="FILE", help="p99 TTFT and ITL vs rate")
    g.add_argument("--records-dir", metavar="DIR", help="bench-format run dirs per policy/rate")
    from kvserve.cli.simulate_parallel import add_arguments as add_parallel_arguments

    add_parallel_arguments(p)
    p.set_defaults(func=run)


def _deployment(args: argparse.Namespace, profile_path: str | None):
    from kvserve.lab.plan import Assumptions, load_model
    from kvserve.lab.sim.cost import StepProfile
    from kvserve.lab.sim.setup import profile_deployment, roofline_deployment

    if profile_path:
        profile = StepProfile.load(profile_path)
        if profile.meta.get("fit", {}).get("poor"):
            bad = "; ".join(profile.meta["fit"].get("violations", []))
            print(f"WARNING: {profile_path} is a POOR FIT ({bad})", file=sys.stderr)
        return profile_deployment(
            profile, noise=False if args.step_noise == "off" else args.step_noise, seed=args.seed
        )
    if not args.model:  # the default model, as `serve` (issue 46)
        from kvserve.models import DEFAULT_MODEL, resolve_model

        print(
            f"kvserve simulate: no MODEL given: the default model, {DEFAULT_MODEL}", file=sys.stderr
        )
        args.model = str(resolve_model(DEFAULT_MODEL))
    else:  # a built-in name or a GGUF file: its model directory, as `plan`
        from kvserve.gguf.model_dir import is_gguf_path
        from kvserve.models import BUILTIN_MODELS, resolve_model

        if args.model in BUILTIN_MODELS or is_gguf_path(args.model):
            args.model = str(resolve_model(args.model))
    assumptions = Assumptions(
        mfu=args.mfu, bandwidth_fraction=args.bw_fraction, overhead_bytes=args.overhead_gb * 1e9
    )
    kv_bytes = args.kv_cache_gb * 1e9 if args.kv_cache_gb is not None else None
    return roofline_deployment(
        load_model(args.model),
        hardware_from_args(args),
        args.weights,
        args.kv_dtype,
        assumptions,
        args.step_overhead_ms / 1e3,
        kv_bytes,
    )


def _write_records(root: Path, result: dict, run) -> None:
    from kvserve.lab.bench.records import write_jsonl
    from kvserve.lab.bench.summary import json_safe

    rate = result["nominal_rate_rps"]
    out = root / f"{result['policy']}_rate_{'trace' if rate is None else f'{rate:g}'}"
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "requests.jsonl", run.records())
    summary = json_safe(result["summary"] | {"sim": result["sim"], "source": "kvserve simulate"})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


def _simulate(args: argparse.Namespace, profile_path: str | None) -> int:
    from kvserve import __version__
    from kvserve.lab.bench.slo import ObjectiveSet
    from kvserve.lab.bench.summary import json_safe
    from kvserve.lab.plan import Prices
    from kvserve.lab.sim.report import plot_rates, render_capacity, render_rejections, render_runs
    from kvserve.lab.sim.study import Policy, evaluate, search_capacity

    deployment = _deployment(args, profile_path)
    source, rates, workload_desc, sample = workload_source_from_args(args)
    max_len_needed = max(r.num_prompt_tokens + r.num_output_tokens for r in sample)
    shape = engine_shape_from_args(args, deployment, max_len_needed)
    policies = tuple(Policy.parse(name) for name in args.policy.split(",") if name.strip())
    objective_sets = tuple(ObjectiveSet.parse(s) for s in args.slo)
    usd_per_hour = args.price_per_hour
    price_source = "given" if usd_per_hour is not None else None
    if usd_per_hour is None and not profile_path:
        usd_per_hour, price_source = Prices().hourly_usd(hardware_from_args(args))
    log = sys.stderr if args.json else sys.stdout
    runs = []
    for rate in rates:
        requests = source(rate)
        for policy in policies:
            result, run = evaluate(
                policy, shape, deployment.cost_model, requests, rate, objective_sets, usd_per_hour
            )
            runs.append(result)
            if args.records_dir:
                _write_records(Path(args.records_dir), result, run)
    capacity = []
    if args.find_capacity:
        for policy in policies:
            capacity.append(
                search_capacity(
                    policy,
                    source,
                    shape,
                    deployment.cost_model,
                    objective_sets,
                    args.min_attainment,
                    args.capacity_start,
                    args.capacity_max,
                    args.capacity_tol,
                    args.capacity_max_trials,
                    usd_per_hour,
                )
            )
    doc = {
        "kvserve_version": __version__,
        "command": sys.argv,
        "deployment": deployment.description,
        "engine": shape.describe(),
        "workload": workload_desc,
        "mode": "forced length (ignore_eos, max_tokens = the output length)",
        "objectives": [o.name for o in objective_sets],
        "min_attainment": args.min_attainment,
        "price": {"usd_per_hour": usd_per_hour, "source": price_source},
        "runs": runs,
        "capacity": capacity,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(json_safe(doc), indent=1))
    if args.json:
        print(json.dumps(json_safe(doc), indent=1))
    else:
        print(_header(doc), file=log)
        print(render_runs(runs), end="", file=log)
        print(render_rejections(runs), end="", file=log)
        for name in doc["objectives"]:
            print(f"goodput objective: {name}", file=log)
        if capacity:
            print(render_capacity(capacity), end="", file=log)
    if args.plot:
        title = f"{deployment.description.get('model', '')} {workload_desc.get('kind', '')}"
        print(f"plot written to {plot_rates(args.plot, runs, title)}", file=log)
    return 0


def _header(doc: dict) -> str:
    d, e = doc["deployment"], doc["engine"]
    what = d.get("model", "profile")
    if d["cost_model"] == "roofline":
        what += f" on {d['hardware']} ({d['weights']}, KV {d['kv_dtype']})"
    return (
        f"{what}; cost model {d['cost_model']}; KV cache {e['kv_cache_tokens']} tokens "
        f"({e['num_blocks']} blocks); max {e['max_num_seqs']} seqs; "
        f"{doc['mode']}; price {doc['price']['usd_per_hour']} USD/h"
    )


def run(args: argparse.Namespace) -> int:
    from kvserve.lab.bench.records import BenchError
    from kvserve.lab.plan import PlanError
    from kvserve.lab.sim.workload import SimError

    try:
        profile_path = args.profile
        if args.quantization and not args.calibrate:
            raise ValueError(
                "--quantization is the engine's for --calibrate (a server's steps ran its own "
                "format; the roofline takes --weights)"
            )
        if args.calibrate_server:
            from kvserve.lab.sim.server_steps import calibrate_server_main

            profile_path = calibrate_server_main(args)
            if not (args.trace or args.request_rate or args.find_capacity):
                return 0
        elif args.calibrate:
            from kvserve.lab.calibration import calibrate_main

            profile_path = calibrate_main(args)
            if not (args.trace or args.request_rate or args.find_capacity):
                return 0
        if args.parallel:
            from kvserve.cli.simulate_parallel import run_layouts

            return run_layouts(args)
        return _simulate(args, profile_path)
    except (SimError, PlanError, BenchError, ValueError) as exc:
        print(f"kvserve simulate: {exc}", file=sys.stderr)
        return 2
