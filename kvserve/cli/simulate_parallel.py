"""`kvserve simulate --parallel 8x1,1x8`: the same workload on several ways to spend the devices
(tensor parallel x data parallel replicas behind a router), roofline cost model (docs/parallel.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvserve.cli.simulate_inputs import (
    engine_shape_from_args,
    hardware_from_args,
    workload_source_from_args,
)

EXAMPLE = """\
  kvserve simulate Llama-3.1-8B --parallel 1x8,8x1 --request-rate 2,8,32 \\
      --input-len uniform:1000:3000 --output-len 300 --shared-prefix 16:512
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvserve.cli.plan import add_link_arguments
    from kvserve.lab.sim.parallel import ROUTERS

    g = p.add_argument_group("more than one device (docs/parallel.md)")
    g.add_argument(
        "--parallel",
        metavar="TPxDP,...",
        help="layouts to compare, e.g. 1x8,8x1: DP replicas of TP ranks each (roofline only)",
    )
    add_link_arguments(g)
    g.add_argument(
        "--router", default="affinity", choices=ROUTERS, help="data-parallel routing (affinity)"
    )
    g.add_argument(
        "--shared-prefix",
        metavar="GROUPS:TOKENS",
        help="request i's prompt starts with group i %% GROUPS's common TOKENS-token prefix",
    )


def run_layouts(args: argparse.Namespace) -> int:
    """Every layout x rate x policy, one table; `--find-capacity` per layout and policy.

    Long: one table's rows built in place, layout by layout; the columns share the loop's locals."""
    from kvserve import __version__
    from kvserve.cli.plan import link_from_args
    from kvserve.lab.bench.slo import ObjectiveSet
    from kvserve.lab.bench.summary import json_safe
    from kvserve.lab.plan import Assumptions, Prices, load_model
    from kvserve.lab.plan.parallel import Parallelism
    from kvserve.lab.sim.parallel import (
        Layout,
        SharedPrefixes,
        evaluate_data_parallel,
        search_capacity_data_parallel,
        tensor_parallel_deployment,
    )
    from kvserve.lab.sim.report import render_capacity, render_runs
    from kvserve.lab.sim.study import Policy
    from kvserve.lab.sim.workload import SimError

    if args.profile or args.calibrate:
        raise SimError("--parallel uses the roofline cost model: drop --profile / --calibrate")
    if not args.model:
        raise SimError("give a MODEL (preset, directory, config.json) with --parallel")
    layouts = tuple(Layout.parse(t) for t in args.parallel.split(",") if t.strip())
    model, hardware, link = load_model(args.model), hardware_from_args(args), link_from_args(args)
    shared = SharedPrefixes.parse(args.shared_prefix) if args.shared_prefix else None
    source, rates, workload_desc, sample = workload_source_from_args(args)
    max_len_needed = max(r.num_prompt_tokens + r.num_output_tokens for r in sample)
    policies = tuple(Policy.parse(n) for n in args.policy.split(",") if n.strip())
    policies = tuple(p for p in policies if not p.is_static)
    if not policies:
        raise SimError("--parallel runs the continuous policies (static is single-replica only)")
    objective_sets = tuple(ObjectiveSet.parse(s) for s in args.slo)
    per_device_usd, price_source = (
        (args.price_per_hour, "given")
        if args.price_per_hour is not None
        else Prices().hourly_usd(hardware)
    )
    assumptions = Assumptions(
        mfu=args.mfu, bandwidth_fraction=args.bw_fraction, overhead_bytes=args.overhead_gb * 1e9
    )
    kv_bytes = args.kv_cache_gb * 1e9 if args.kv_cache_gb is not None else None
    runs, capacity, deployments = [], [], []
    for layout in layouts:
        parallelism = Parallelism(
            layout.tensor_parallel, layout.data_parallel, link, args.remote_core_latency_us * 1e-6
        )
        deployment = tensor_parallel_deployment(
            model,
            hardware,
            parallelism,
            args.weights,
            args.kv_dtype,
            assumptions,
            args.step_overhead_ms / 1e3,
            kv_bytes,
        )
        shape = engine_shape_from_args(args, deployment, max_len_needed)
        usd = None if per_device_usd is None else per_device_usd * parallelism.num_devices
        deployments.append(
            {"layout": layout.name, "engine_per_replica": shape.describe()} | deployment.description
        )
        common = (layout.data_parallel, args.router, shared)
        for rate in rates:
            requests = source(rate)
            for policy in policies:
                result, _ = evaluate_data_parallel(
                    policy,
                    shape,
                    deployment.cost_model,
                    requests,
                    rate,
                    *common,
                    objective_sets,
                    usd,
                    message_s=parallelism.core_message_s,
                )
                runs.append(result | {"policy": f"{policy.name} {layout.name}"})
        if args.find_capacity:
            for policy in policies:
                found = search_capacity_data_parallel(
                    policy,
                    source,
                    shape,
                    deployment.cost_model,
                    layout.data_parallel,
                    objective_sets,
                    args.router,
                    shared,
                    args.min_attainment,
                    args.capacity_start,
                    args.capacity_max,
                    args.capacity_tol,
                    args.capacity_max_trials,
                    usd,
                    message_s=parallelism.core_message_s,
                )
                capacity.append(found | {"policy": f"{policy.name} {layout.name}"})
    doc = {
        "kvserve_version": __version__,
        "command": sys.argv,
        "deployments": deployments,
        "router": args.router,
        "shared_prefix": None if shared is None else vars(shared),
        "workload": workload_desc,
        "mode": "forced length (ignore_eos, max_tokens = the output length)",
        "objectives": [o.name for o in objective_sets],
        "price": {"usd_per_device_hour": per_device_usd, "source": price_source},
        "runs": runs,
        "capacity": capacity,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(json_safe(doc), f, indent=1)
    if args.json:
        print(json.dumps(json_safe(doc), indent=1))
        return 0
    for d in deployments:
        print(_layout_line(d))
    print(
        f"router {args.router}; shared prefix {args.shared_prefix or 'none'}; {doc['mode']}; "
        f"{per_device_usd} USD per device-hour ({price_source})"
    )
    print(render_runs(runs), end="")
    for name in doc["objectives"]:
        print(f"goodput objective: {name}")
    if capacity:
        print(render_capacity(capacity), end="")
    return 0


def _layout_line(d: dict[str, Any]) -> str:
    e = d["engine_per_replica"]
    return (
        f"{d['layout']}: {d['model']} on {d['num_devices']} x {d['hardware']} "
        f"({d['weights']}, KV {d['kv_dtype']}); weights {d['weight_bytes_per_device'] / 1e9:.3g} "
        f"GB per device; KV cache {e['kv_cache_tokens']:,} tokens per replica; "
        f"{d['interconnect']} all-reduce {d['allreduce_bytes_per_layer_per_token']:,.0f} B per "
        "layer per token"
    )
