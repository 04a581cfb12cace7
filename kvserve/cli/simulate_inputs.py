"""What `kvserve simulate` and its `--tensor-parallel` / `--data-parallel` layouts
(cli/simulate_parallel.py) both read from the command line: the hardware, the engine's shape and the
workload. Heavy imports stay inside the functions (cli/__init__.py)."""

from __future__ import annotations

import argparse

from kvserve.config import SchedulerConfig


def hardware_from_args(args: argparse.Namespace):
    from kvserve.lab.plan.hardware import get_profile, manual_profile

    manual = (args.memory, args.bandwidth, args.peak)
    base = get_profile(args.hardware) if args.hardware else None
    if all(v is None for v in manual):
        return base or get_profile("h100-sxm")
    return manual_profile(*manual, base=base)


def engine_shape_from_args(args: argparse.Namespace, deployment, max_len_needed: int):
    from kvserve.lab.bench.slo import parse_duration_s
    from kvserve.lab.sim.study import EngineShape

    d = deployment.defaults

    def pick(value, key, fallback):
        return value if value is not None else d.get(key, fallback)

    block_size = pick(args.block_size, "block_size", 16)
    max_model_len = pick(args.max_model_len, "max_model_len", max_len_needed)
    layout = deployment.layout(max_model_len)  # a hybrid model's KV groups (kv/groups.py)
    num_blocks = args.num_blocks or d.get("num_blocks") or deployment.num_blocks(block_size, layout)
    speculative = None
    if args.speculative_k:
        from kvserve.lab.sim.speculative import SpecModel

        speculative = SpecModel(
            args.speculative_k, args.acceptance, args.draft_step_ms / 1e3, args.draft_token_ms / 1e3
        )
    return EngineShape(
        speculative=speculative,
        seed=args.seed,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_seqs=pick(args.max_num_seqs, "max_num_seqs", SchedulerConfig.max_num_seqs),
        chunk_tokens=pick(args.chunk_tokens, "max_num_batched_tokens", 512),
        enable_prefix_caching=not args.no_prefix_caching and d.get("enable_prefix_caching", True),
        static_batch_size=args.static_batch_size,
        static_timeout_s=parse_duration_s(args.static_timeout),
        layout=layout,
    )


def workload_source_from_args(args: argparse.Namespace):
    """(rate -> requests, the rates to run, workload description)."""
    from kvserve.lab.bench.workloads import LengthDist
    from kvserve.lab.sim.workload import (
        Workload,
        nominal_rate,
        requests_from_trace,
        scale_arrivals,
    )

    input_len, output_len = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    if args.trace:
        trace = requests_from_trace(args.trace, input_len, output_len, args.seed)
        base = nominal_rate(trace)
        rates = args.request_rate or (base,)

        def from_trace(rate: float | None):
            if rate is None or base is None or rate == base:
                return trace
            return scale_arrivals(trace, rate / base)

        desc = {"kind": "trace", "path": args.trace, "num_requests": len(trace), "rate": base}
        return from_trace, rates, desc, trace
    workload = Workload(
        input_len, output_len, args.num_requests, args.warmup, args.burstiness, args.seed
    )
    rates = args.request_rate or (1.0,)
    return workload.requests, rates, workload.describe(), workload.requests(1.0)
