"""`kvserve plan`: capacity arithmetic for a model on hardware; `--measure` this machine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EPILOG = """\
examples:
  kvserve plan SmolLM2-135M --hardware h100-sxm
  kvserve plan Llama-3.1-8B --weights int4-g128 --kv-dtype fp8 --prompt 4000 --output 800 --compare
  kvserve plan ./my-model/ --weights mixed --memory 24 --bandwidth 1008 --peak 165
  kvserve plan Qwen2.5-7B --hardware rtx-4090 --device-cost 1800 --power-w 450 --json
  kvserve plan --measure                  # save this machine's roofline, then:
  kvserve plan SmolLM2-135M --hardware this-machine --weights fp32 --plot roofline.png
  kvserve plan Llama-3.1-70B --hardware h100-sxm --tensor-parallel 8 --interconnect nvlink4

weight formats: bf16 fp16 fp32 | int8 (per channel) | int4-g128 int4-g64 int4-g32 int4-g128-zp
  (block linears quantised, the rest bf16) | mixed | linear=FMT,embed=FMT,head=FMT,norm=FMT
hardware: h100-sxm a100-80gb l40s l4 rtx-4090 m2-ultra ddr5-desktop this-machine, or a profile JSON
interconnects: nvlink4 nvlink3 pcie5 pcie4 ethernet-100g ethernet-10g (docs/parallel.md)
"""


def register(subparsers: Any) -> None:
    """Long: the `plan` flags, one declaration each, in help order."""
    p = subparsers.add_parser(
        "plan",
        help="capacity, latency and cost arithmetic for a model on hardware",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="preset name, HF model directory, or config.json")
    g = p.add_argument_group("formats")
    add_format_arguments(g)
    g = p.add_argument_group("hardware")
    g.add_argument(
        "--hardware",
        metavar="NAME|PATH",
        help="built-in profile, this-machine, or a profile JSON (default h100-sxm)",
    )
    add_device_arguments(g)
    g.add_argument(
        "--compare",
        nargs="?",
        const="all",
        metavar="NAMES",
        help="also tabulate across profiles (comma list; default all built-ins and a "
        "saved this-machine)",
    )
    g = p.add_argument_group("more than one device (docs/parallel.md)")
    g.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N", help="ranks per replica (1)"
    )
    g.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="M",
        help="replicas (1: as many as --requests-per-day needs, for the cost)",
    )
    add_link_arguments(g)
    # the defaults are Workload's and Prices' (kvserve/lab/plan)
    from kvserve.lab.plan.figures import Workload
    from kvserve.lab.plan.planner import Prices

    g = p.add_argument_group("workload")
    g.add_argument(
        "--prompt", type=int, default=Workload.prompt_tokens, metavar="TOKENS", help="prompt tokens"
    )
    g.add_argument(
        "--output", type=int, default=Workload.output_tokens, metavar="TOKENS", help="output tokens"
    )
    g.add_argument(
        "--shared-prefix",
        type=int,
        default=Workload.shared_prefix_tokens,
        metavar="TOKENS",
        help="prompt tokens every request shares, cached (0)",
    )
    g.add_argument(
        "--requests-per-day",
        type=float,
        default=Workload.requests_per_day,
        metavar="N",
        help="requests per day, for the cost",
    )
    g = p.add_argument_group("prices")
    g.add_argument(
        "--price-per-hour", type=float, metavar="USD", help="rental price per device-hour"
    )
    g.add_argument(
        "--device-cost", type=float, metavar="USD", help="purchase price of an owned device"
    )
    g.add_argument("--power-w", type=float, metavar="W", help="owned device power (profile's)")
    g.add_argument(
        "--electricity",
        type=float,
        default=Prices.electricity_usd_per_kwh,
        metavar="USD/kWh",
        help="electricity price",
    )
    g.add_argument(
        "--years", type=float, default=Prices.amortisation_years, help="amortisation years"
    )
    g = p.add_argument_group("assumptions")
    add_assumption_arguments(g)
    g.add_argument(
        "--utilisation",
        type=float,
        metavar="U",
        help="utilisation for the cost (default: what the requests per day imply)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print JSON instead of text")
    g.add_argument("--plot", metavar="FILE", help="write a roofline plot (png, pdf, svg)")
    g = p.add_argument_group("measure this machine")
    g.add_argument("--measure", action="store_true", help="measure GEMV bandwidth and GEMM FLOP/s")
    g.add_argument(
        "--save", metavar="PATH", help="where to save it (default: the this-machine profile)"
    )
    g.add_argument("--device", default="cpu", help="torch device to measure (cpu)")
    g.add_argument(
        "--measure-formats",
        default="fp32,int8,int4-g32",
        metavar="FMTS",
        help="weight formats whose engine linear kernels to time (CPU; 'none' to skip)",
    )
    g.add_argument(
        "--measure-model",
        default=None,
        metavar="MODEL",
        help="time the engine linears over this model's own matrices (default: one large one) "
        "and the engine's work outside the forward on it (sampler, runner, scheduler)",
    )
    g.add_argument(
        "--measure-contexts",
        default="128,512,2048",
        metavar="TOKENS",
        help="contexts at which to time the engine's decode attention (CPU; at least two)",
    )
    g.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="dtype to measure (fp32 on cpu, bf16 on an accelerator)",
    )
    g.add_argument("--budget-s", type=float, help="time budget for the GEMM sweep")
    p.set_defaults(func=run)


def _hardware(args: argparse.Namespace, measured: Any = None) -> Any:
    from kvserve.lab.plan.hardware import get_profile, manual_profile

    manual = (args.memory, args.bandwidth, args.peak)
    if measured is not None:
        base = measured
    elif args.hardware:
        base = get_profile(args.hardware)
    elif all(v is None for v in manual):
        base = get_profile("h100-sxm")
    else:
        base = None
    if base is not None and all(v is None for v in manual):
        return base
    return manual_profile(*manual, base=base)


def link_from_args(args: argparse.Namespace) -> Any:
    """--interconnect NAME, edited by --link-bandwidth GB/s, --link-latency-us and --link-delay-us
    (plan and simulate share these flags). A ring step waits for the network's one-way delay twice:
    gloo's TCP transport sends a chunk once its receiver has said it is ready (docs/parallel.md,
    "The link with a delay and a rate": within 15% at 0.2 and 1 ms)."""
    from dataclasses import replace

    from kvserve.lab.plan import PlanError
    from kvserve.lab.plan.parallel import RING_STEP_DELAYS, get_interconnect

    link = get_interconnect(args.interconnect)
    delay_us = args.link_delay_us or 0.0
    if delay_us < 0:
        raise PlanError(f"--link-delay-us {args.link_delay_us}: a delay is >= 0")
    if args.link_bandwidth is None and args.link_latency_us is None and not delay_us:
        return link
    latency_s = args.link_latency_us * 1e-6 if args.link_latency_us is not None else link.latency_s
    return replace(
        link,
        name=f"{link.name} (edited)",
        bandwidth_bytes_per_s=(
            args.link_bandwidth * 1e9
            if args.link_bandwidth is not None
            else link.bandwidth_bytes_per_s
        ),
        latency_s=latency_s + RING_STEP_DELAYS * delay_us * 1e-6,
        source=link.source + " Edited by hand.",
    )


# The roofline's inputs, the same flags in `kvserve plan` and `kvserve simulate`: declared here once.
KV_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8")


def add_format_arguments(g: Any) -> None:
    g.add_argument("--weights", default="bf16", metavar="FMT", help="weight format (default bf16)")
    g.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES, help="KV cache element type")


def add_device_arguments(g: Any) -> None:
    """What overrides the hardware profile's figures."""
    g.add_argument("--memory", type=float, metavar="GB", help="device memory, GB")
    g.add_argument("--bandwidth", type=float, metavar="GB/s", help="memory bandwidth, GB/s")
    g.add_argument("--peak", type=float, metavar="TFLOP/s", help="dense peak, TFLOP/s")


def add_assumption_arguments(g: Any) -> None:
    """`Assumptions`' fields (kvserve/lab/plan/planner.py), with its defaults."""
    from kvserve.lab.plan.planner import Assumptions

    g.add_argument(
        "--mfu",
        type=float,
        default=Assumptions.mfu,
        help="prefill (prompt-chunk) model FLOP utilisation",
    )
    g.add_argument(
        "--bw-fraction",
        type=float,
        metavar="F",
        help="fraction of peak bandwidth achieved (0.8 of a datasheet, 1.0 of a measurement)",
    )
    g.add_argument(
        "--overhead-gb",
        type=float,
        default=Assumptions.overhead_bytes / 1e9,
        metavar="GB",
        help="runtime memory besides weights and KV cache",
    )


def add_link_arguments(g: Any) -> None:
    g.add_argument(
        "--interconnect", default="nvlink4", metavar="NAME", help="link profile (nvlink4)"
    )
    g.add_argument("--link-bandwidth", type=float, metavar="GB/s", help="per direction, per rank")
    g.add_argument(
        "--link-latency-us", type=float, metavar="US", help="per ring step: the software's cost"
    )
    g.add_argument(
        "--link-delay-us",
        type=float,
        metavar="US",
        help="the network's one-way delay between hosts, paid twice per ring step (gloo's TCP "
        "transport waits for the receiver's ready notice, then the data; docs/parallel.md)",
    )
    g.add_argument(
        "--remote-core-latency-us",
        type=float,
        default=0.0,
        metavar="US",
        help="engine cores on other hosts: one message's time, one way (0: local cores)",
    )


def _parallel(args: argparse.Namespace) -> Any:
    from kvserve.lab.plan.parallel import Parallelism

    flags = (args.tensor_parallel, args.data_parallel, args.link_bandwidth, args.link_latency_us)
    remote_s = args.remote_core_latency_us * 1e-6
    edited = args.interconnect != "nvlink4" or args.link_delay_us
    if flags == (1, 1, None, None) and not edited and not remote_s:
        return None
    return Parallelism(args.tensor_parallel, args.data_parallel, link_from_args(args), remote_s)


def _compare_profiles(spec: str) -> list[Any]:
    from kvserve.lab.plan.hardware import BUILTIN, THIS_MACHINE, default_profile_path, get_profile

    if spec != "all":
        return [get_profile(name) for name in spec.split(",") if name.strip()]
    profiles = list(BUILTIN.values())
    if default_profile_path().is_file():
        profiles.append(get_profile(THIS_MACHINE))
    return profiles


def _measure(args: argparse.Namespace) -> Any:
    """Long: one measurement session in the order it prints (roofline, engine kernels, host cost);
    split, its many shared locals would travel as arguments."""
    from dataclasses import replace

    from kvserve.lab.measure import default_config, measure_roofline
    from kvserve.lab.plan.hardware import save_profile
    from kvserve.lab.plan.report import fmt_bw, fmt_flops, fmt_s

    cfg = default_config(args.device, args.dtype)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    try:
        contexts = tuple(int(c) for c in args.measure_contexts.split(",") if c.strip())
        cfg = replace(cfg, attention_contexts=contexts)
    except ValueError as exc:
        from kvserve.lab.plan import PlanError

        raise PlanError(f"--measure-contexts {args.measure_contexts!r}: {exc}") from exc
    out = sys.stderr if args.json else sys.stdout
    print(f"measuring {args.device} in {cfg.dtype} (about a minute at most)...", file=out)

    def show(p: Any) -> None:
        if p.kind == "attention":
            print(
                f"  {'decode attention':<24} {p.num_columns:>3} rows {fmt_bw(p.bytes_per_s):>12}",
                file=out,
            )
            return
        if p.kind == "attention-time":
            what = f"attention at {p.context_tokens}"
            print(
                f"  {what:<24} {p.num_columns:>3} rows {fmt_s(p.median_s):>10} per layer", file=out
            )
            return
        if p.kind.startswith("pool-layer:"):
            what = f"{p.kind} at {p.context_tokens}"
            print(
                f"  {what:<24} {p.num_columns:>3} rows {fmt_s(p.median_s):>10} per layer "
                f"{fmt_bw(p.bytes_per_s):>12}",
                file=out,
            )
            return
        if p.kind.startswith("engine-"):
            what = f"{p.kind} per step"
            print(f"  {what:<24} {p.num_columns:>3} rows {fmt_s(p.median_s):>10}", file=out)
            return
        if "dispatch" in p.kind or p.kind.endswith("-fixed"):
            path = {"fused": "pooled step", "fork": "fused, forking"}.get(
                p.kind.split("-")[0], "per-op"
            )
            what = "per layer" if p.kind.endswith("dispatch") else "per step"
            what = f"host {what} ({path})"
            print(f"  {what:<24} {p.num_columns:>3} rows {fmt_s(p.median_s):>10}", file=out)
            return
        what = "GEMV" if p.kind == "gemv" else f"GEMM {p.num_columns:>5} columns"
        if p.kind.startswith(("linear:", "linear-fused:", "head:")):
            what = f"{p.kind} {p.num_columns:>3} rows"
        print(
            f"  {what:<20} {fmt_s(p.median_s):>10}  {fmt_flops(p.flops_per_s):>15}  "
            f"{fmt_bw(p.bytes_per_s):>12}  intensity {p.intensity_flops_per_byte:.3g}",
            file=out,
        )

    profile = measure_roofline(cfg, progress=show)
    if args.device == "cpu" and args.measure_formats != "none":
        # the engine's own kernels and host cost (docs/planning.md, a measured engine profile)
        formats = tuple(f for f in args.measure_formats.split(",") if f)
        if args.measure_model:  # the pooled step's host cost on the model's own layer shapes
            from kvserve.lab.measure_pool import measure_engine_on_model
            from kvserve.lab.plan import load_model

            spec = load_model(_builtin_to_dir(args.measure_model))
            points = measure_engine_on_model(cfg, formats, spec, progress=show)
        else:
            from kvserve.lab.measure_engine import measure_engine

            spec = None
            points = measure_engine(cfg, formats, progress=show)
        if args.measure_model:  # the engine outside the forward, on the real engine
            from kvserve.lab.measure_overhead import measure_overhead

            points += measure_overhead(_builtin_to_dir(args.measure_model), progress=show)
        fused = [p.num_columns for p in points if p.kind == "fused-dispatch"]
        import torch

        from kvserve.lab.measure_engine import fused_profile_fields

        profile = replace(
            profile,
            points=profile.points + tuple(points),
            **fused_profile_fields(points, torch.get_num_threads()),
            source=profile.source
            + "; engine linears ("
            + ", ".join(formats)
            + ") over "
            + (f"{spec.name}'s matrices" if spec else "one large matrix")
            + ", decode attention at contexts "
            + ",".join(str(c) for c in cfg.attention_contexts)
            + ", host cost per layer of the per-op path"
            + (f" and of the fused step (<= {max(fused)} rows)" if fused else "")
            + (", the engine outside the forward" if args.measure_model else "")
            + " (kvserve.lab.measure_engine)",
        )
    path = save_profile(profile, args.save)
    print(
        f"bandwidth {fmt_bw(profile.bandwidth_bytes_per_s)}, "
        f"peak {fmt_flops(profile.peak_flops_per_s)} ({profile.compute_dtype}), "
        f"ridge {profile.ridge_flops_per_byte:.3g} FLOP/byte; saved to {path}",
        file=out,
    )
    return profile


def _builtin_to_dir(model: str) -> str:
    """A built-in name or a GGUF file -> its model directory; anything else unchanged."""
    from kvserve.gguf.model_dir import is_gguf_path
    from kvserve.models import BUILTIN_MODELS, resolve_model

    return str(resolve_model(model)) if model in BUILTIN_MODELS or is_gguf_path(model) else model


def run(args: argparse.Namespace) -> int:
    from kvserve.lab.plan import (
        Assumptions,
        PlanError,
        Prices,
        Workload,
        load_model,
        make_plan,
        parse_weight_format,
    )
    from kvserve.lab.plan.report import compare_row, render_compare, render_text

    try:
        measured = _measure(args) if args.measure else None
        if not args.model and measured is None:  # the default model, as `serve` (issue 46)
            from kvserve.models import DEFAULT_MODEL

            print(
                f"kvserve plan: no MODEL given: the default model, {DEFAULT_MODEL}", file=sys.stderr
            )
            args.model = DEFAULT_MODEL
        if not args.model:
            if args.plot:
                from kvserve.lab.plan.plot import plot_roofline

                print(f"roofline written to {plot_roofline(args.plot, measured)}")
            if args.json:
                print(json.dumps(measured.to_dict(), indent=2))
            return 0
        model = load_model(_builtin_to_dir(args.model))
        fmt = parse_weight_format(args.weights)
        hardware = _hardware(args, measured)
        workload = Workload(args.prompt, args.output, args.shared_prefix, args.requests_per_day)
        assumptions = Assumptions(
            mfu=args.mfu,
            bandwidth_fraction=args.bw_fraction,
            overhead_bytes=args.overhead_gb * 1e9,
            utilisation=args.utilisation,
        )
        prices = Prices(
            args.price_per_hour, args.device_cost, args.power_w, args.electricity, args.years
        )
        parallel = _parallel(args)
        plan = make_plan(
            model, hardware, fmt, args.kv_dtype, workload, assumptions, prices, parallel
        )
        others = []
        if args.compare:
            # Each profile at its own reference price: a price given by hand fits one device only.
            base_prices = Prices(
                electricity_usd_per_kwh=args.electricity, amortisation_years=args.years
            )
            others = [
                make_plan(
                    model, hw, fmt, args.kv_dtype, workload, assumptions, base_prices, parallel
                )
                for hw in _compare_profiles(args.compare)
            ]
        if args.plot:
            from kvserve.lab.plan.plot import plot_roofline

            plot_path = plot_roofline(args.plot, hardware, plan)
    except PlanError as exc:
        print(f"kvserve plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        data = plan.to_dict()
        if others:
            data["compare"] = [compare_row(p) for p in others]
        from kvserve.lab.bench.summary import json_safe

        print(json.dumps(json_safe(data), indent=2, allow_nan=False))
    else:
        print(render_text(plan), end="")
        if others:
            print("\nCompare (profile reference prices; not the prices given above)")
            print(render_compare(others), end="")
        if args.plot:
            print(f"\nroofline written to {plot_path}")
    return 0
