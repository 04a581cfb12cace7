"""The planner's decode step against the measured one, on this machine, in one sitting.

1. A drift probe (the GEMV bandwidth, the host cost per layer of the fused step and of the per-op
   path) before and after the profile and before and after each format's steps, so that the
   machine's speed moving under the run is in the JSON (`probes`, `drift`, and per row
   `gemv_speed_vs_profile`: the probes around its steps over those around the profile) rather
   than in the ratios unnoticed.
2. `kvserve plan --measure --measure-model MODEL --measure-contexts C1,C2 --save PROFILE`: the
   roofline and the engine's own kernels for each step shape it runs (docs/planning.md, "A
   measured engine profile"), the decode attention timed at the contexts predicted below.
3. The plan (what `kvserve plan --hardware PROFILE` computes: kvserve.lab.plan.engine_cost, and the
   bare roofline beside it) for batch 1, 4, 16 at contexts 128 and 2000, for each weight format.
4. `kvserve bench latency` measures the decode steps (median) at the same batch and context, the
   formats in A B C order at the first context and C B A at the next (a linear drift then biases
   no format); right after each, the model's forward alone is timed (`forward`), which splits a
   miss into the model's part and the engine's host work outside it.
5. The table: plan, the bound it names (the largest part of the step: `memory` = the bytes at the
   GEMV bandwidth, `kernel` = what the measured kernels take beyond that, `dispatch` = host cost),
   measured, measured / plan, and the cause of every gap over 15% and of every step that is not
   memory-bound.

Weight formats (`--weights`, a ';' list of the engine's `--quantization` values): fp32, int8 and
`linear=int4-g32,head=int8` by default; the plan prices the same tensors in the same formats.

    kv-bench /work/main/.venv/bin/python benchmarks/plan_vs_measured.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The probes and the forward timed alone run in this process: with the OpenMP settings the
# `kvserve` command line (the profile, bench latency) starts with (kvserve/threads.py), set before
# torch loads. Without them the idle threads spin, the fused step's forking path and the per-op
# path skip the futex wake-ups the engine pays, and the forward alone came out 9-24 ms faster
# than inside the engine's step at 4 x 128 and 1 x 2000 (docs/planning.md).
from kvserve.threads import apply_thread_defaults  # noqa: E402

apply_thread_defaults()

from benchmarks._plan_explain import TOLERANCE, explain, print_table  # noqa: E402
from kvserve.lab.plan import KVFormat, arith, load_model, parse_weight_format  # noqa: E402
from kvserve.lab.plan.engine_cost import EngineCost  # noqa: E402
from kvserve.lab.plan.hardware import get_profile  # noqa: E402

COMMANDS: list[str] = []


def kvserve(*args: str) -> None:
    COMMANDS.append("kvserve " + " ".join(args))
    print("+ " + COMMANDS[-1], flush=True)
    subprocess.run([sys.executable, "-m", "kvserve", *args], check=True, cwd=ROOT)


def probe(label: str) -> dict:
    """The machine's speed now: GEMV bandwidth, and the host cost per layer of the fused step (1
    row) and of the per-op path (16 rows), from the same code `--measure` runs, shortened."""
    import torch

    from kvserve.lab.measure import MeasureConfig, measure_gemv
    from kvserve.lab.measure_engine import measure_dispatch

    cfg = MeasureConfig(min_time_s=0.3, min_samples=5, dispatch_rounds=1)
    with torch.inference_mode():
        gemv = measure_gemv(cfg)
        points = measure_dispatch(cfg, rows=(16,), fused_shape_rows=(1,))
        host = {(p.kind, p.num_columns): p.median_s for p in points}
    out = {
        "label": label,
        "time": time.strftime("%H:%M:%S", time.gmtime()),
        "gemv_bytes_per_s": gemv.bytes_per_s,
        "per_op_layer_s_16_rows": host[("dispatch", 16)],
        "fused_layer_s_1_row": host.get(("fused-dispatch", 1)),
    }
    print(f"probe {label}: " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()
                                         if isinstance(v, float)), flush=True)  # fmt: skip
    return out


def drift(probes: list[dict]) -> dict:
    """Each probe quantity's largest / smallest over the run (1.0 = steady)."""
    out = {}
    for key in ("gemv_bytes_per_s", "per_op_layer_s_16_rows", "fused_layer_s_1_row"):
        values = [p[key] for p in probes if p.get(key)]
        if values:
            out[key] = {"min": min(values), "max": max(values), "max_over_min": max(values) /
                        min(values)}  # fmt: skip
    return out


def measure_steps(
    model: str, weights: str, batches: str, context: int, out: Path, args, long: bool
) -> dict:
    """Measured decode step medians {batch: (seconds, mean decode context, the number of steps at
    the batch's rows (`decode_step_p50`), the number of decode steps)}. At the longest
    context the prefill dominates the wall time (B = 4 x 2000 tokens: ~50 s here), so it runs
    `--long-iters` iterations after `--long-warmup-iters` (the decode steps are the medians of
    all of them either way)."""
    iters, warmup = (args.long_iters, args.long_warmup_iters) if long else (args.iters, 1)
    run = out / f"latency_{weights.replace('=', '-').replace(',', '_')}_{context}"
    extra = [] if weights == "fp32" else ["--quantization", weights]
    prompt = context - args.output_len // 2  # the mean decode context is prompt + output / 2
    kvserve(
        "bench", "latency", "--model", model, "--batch-sizes", batches,
        "--prompt-lens", str(prompt), "--output-lens", str(args.output_len),
        "--iters", str(iters), "--warmup-iters", str(warmup), "--check-prompts", "1",
        "--dtype", "float32", "--hardware", "none", "--no-plot",
        "--kv-cache-memory", str(args.kv_cache_memory), "--out", str(run), *extra,
    )  # fmt: skip
    doc = json.loads((run / "latency.json").read_text())
    return {pt["batch_size"]: (decode_step_p50(pt), pt["prompt_len"] + pt["output_len"] / 2,
                               pt["decode"]["num_full_batch_steps"],
                               pt["decode"]["step_s"]["count"])
            for pt in doc["points"]}  # fmt: skip


def decode_step_p50(point: dict) -> float:
    """The median decode step at the batch's rows (`bench latency`'s `batch_step_s`: of the steps
    with every request decoding where there are at least 3, kvserve.lab.bench.phases). With chunked
    prefill the first requests decode while the later prompts fill and finish first, so the decode
    phase's later steps carry fewer rows: at 48 x 504 tokens the median over every decode step was
    67 ms where the 48-row forward alone took 87 (1207)."""
    return point["decode"]["batch_step_s"]


def plan_parts(weights: str, spec) -> dict[str, str]:
    """The planner's format per tensor kind for the engine's `--quantization` of an fp32
    checkpoint: what it names is quantised, the rest stays fp32 (a tied head is the embedding
    table: `embed`)."""
    named = dict(p.split("=") for p in weights.split(",")) if "=" in weights else (
        {} if weights == "fp32" else {"linear": weights})  # fmt: skip
    head = named.get("head", "fp32")
    embed = head if spec.tie_word_embeddings else named.get("embed", "fp32")
    return {"linear": named.get("linear", "fp32"), "embed": embed, "head": head, "norm": "fp32"}


def plan_format(weights: str, spec) -> str:
    """`plan_parts` as the planner's format string ("fp32" when everything is)."""
    if weights == "fp32":
        return "fp32"
    return ",".join(f"{kind}={fmt}" for kind, fmt in plan_parts(weights, spec).items())


def plan_step(spec, profile, weights: str, batch: int, context: float) -> dict:
    """The roofline's step and the measured engine profile's (kvserve plan --hardware PROFILE)."""
    fmt = parse_weight_format(plan_format(weights, spec))
    kv = arith.kv_bytes_per_token(spec, KVFormat("fp32").bytes_per_value(spec.head_dim))
    roofline = arith.RooflineCost(
        spec, fmt.weight_bytes(spec), kv, profile.bandwidth_bytes_per_s, profile.peak_flops_per_s
    )
    out = {"roofline_s": roofline.decode_step_s(batch, context),
           "roofline_bound": roofline.decode_bound(batch, context), "plan_format": fmt.name}  # fmt: skip
    engine = EngineCost.from_profile(spec, fmt, kv, profile)
    if engine is None:
        return out | {"plan_s": out["roofline_s"], "bound": out["roofline_bound"]}
    return out | {
        "plan_s": engine.decode_step_s(batch, context),
        "bound": engine.decode_bound(batch, context),
        "path": engine.path(batch, context),
        "terms_s": engine.terms_s(batch, context),
        "sources": engine.sources(),
    }


def retimed_profile(profile, spec, weights: str, batches: list[int], contexts: list[int]):
    """`profile` with the plan's largest terms timed again now, beside the steps: the pooled step's
    layers (`pool-layer:FMT`, at 16 and the longest context) and the head (`head:FMT`) at the
    rows these steps ran, as `--measure` times them (kvserve/lab/measure_pool.py). The machine's
    speed moves between the profile and the steps (the probes drifted 1.4-4x over one run here);
    the plan from these points holds the planner's arithmetic against the steps at one speed."""
    import dataclasses

    import torch

    from kvserve.lab.measure import MeasureConfig
    from kvserve.lab.measure_pool import measure_head, measure_pool_layers

    parts = plan_parts(weights, spec)
    fixed = [(p.num_columns, p.median_s) for p in profile.points if p.kind == "fused-fixed"]
    cfg = MeasureConfig(attention_contexts=(16, max(contexts)))
    rows = tuple(sorted(batches))
    with torch.inference_mode():
        fresh = measure_pool_layers(cfg, spec, parts["linear"], fixed, rows=rows)
        fresh += measure_head(cfg, spec, parts["head"], rows=rows)
    kinds = {p.kind for p in fresh}
    kept = [p for p in profile.points if p.kind not in kinds]
    return dataclasses.replace(profile, points=tuple(kept) + tuple(fresh))


def measure_profile(args, out: Path, formats: str, contexts: list[int]) -> Path:
    path = Path(args.profile) if args.profile else out / "this-machine.json"
    if not args.profile:
        kvserve("plan", "--measure", "--measure-formats", formats, "--measure-model", args.model,
                "--measure-contexts", ",".join(str(c) for c in sorted(set(contexts))),
                "--budget-s", str(args.gemm_budget_s), "--save", str(path))  # fmt: skip
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/tmp/kv/smol-gpt2", help="fp32 checkpoint directory")
    p.add_argument(
        "--weights",
        default="fp32;int8;linear=int4-g32,head=int8",
        help="';' list of the engine's --quantization formats (fp32 = none)",
    )
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--contexts", default="128,2000")
    p.add_argument("--long-batches", default="1,4", help="batches at the longest context")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--long-iters", type=int, default=1, help="iterations at the longest context")
    p.add_argument("--long-warmup-iters", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="3GB")
    p.add_argument("--gemm-budget-s", type=float, default=10.0, help="the roofline's GEMM sweep")
    p.add_argument("--profile", default=None, help="a measured profile (default: measure now)")
    p.add_argument("--no-forward", action="store_true", help="skip timing the model's forward")
    p.add_argument(
        "--no-retime",
        action="store_true",
        help="skip timing the plan's pooled layers and head again beside each format's steps",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tmp" / "plan"))
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "plan_vs_measured.json"))
    args = p.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    weights_list = args.weights.split(";")
    contexts = [int(c) for c in args.contexts.split(",")]
    formats = ",".join(sorted({"fp32"} | {
        f.split("=")[1] for w in weights_list if w != "fp32"
        for f in (w.split(",") if "=" in w else [f"linear={w}"])
    }))  # fmt: skip
    probes = [probe("start")]
    profile_path = measure_profile(args, out, formats, contexts)
    probes.append(probe("after the profile"))
    profile_gemv = (probes[0]["gemv_bytes_per_s"] + probes[1]["gemv_bytes_per_s"]) / 2
    profile = get_profile(str(profile_path))
    spec = load_model(args.model)
    rows = []
    for i, context in enumerate(contexts):
        batches = args.long_batches if context == max(contexts) and args.long_batches else (
            args.batches)  # fmt: skip
        order = weights_list if i % 2 == 0 else weights_list[::-1]  # A B C, then C B A
        for weights in order:
            long = context == max(contexts) and len(contexts) > 1
            before = probe(f"before {weights} at {context}")
            probes.append(before)
            steps = measure_steps(args.model, weights, batches, context, out, args, long)
            forwards = {}
            if not args.no_forward:  # the model's part of the same steps, timed alone, now
                from kvserve.lab.measure import MeasureConfig
                from kvserve.lab.measure_forward import time_model_forwards

                shapes = [(b, int(t)) for b, (_, t, _, _) in sorted(steps.items())]
                quant = None if weights == "fp32" else weights
                cfg = MeasureConfig(min_time_s=0.5, min_samples=5)
                forwards = time_model_forwards(args.model, shapes, quant, cfg)
            retimed = None
            if not args.no_retime:
                retimed = retimed_profile(profile, spec, weights, sorted(steps), contexts)
            after = probe(f"after {weights} at {context}")
            probes.append(after)
            # the machine's speed while these steps ran, relative to the profile's minutes
            speed = (before["gemv_bytes_per_s"] + after["gemv_bytes_per_s"]) / 2 / profile_gemv
            for batch, (measured_s, t, full, total) in sorted(steps.items()):
                row = {"weights": weights, "batch": batch, "context": t, "measured_s": measured_s,
                       "full_batch_steps": full, "decode_steps": total,
                       "timed_at": time.strftime("%H:%M:%S", time.gmtime()),
                       "gemv_speed_vs_profile": speed}  # fmt: skip
                if (batch, int(t)) in forwards:
                    row["forward_s"] = forwards[(batch, int(t))]
                if retimed is not None:
                    row["plan_now_s"] = plan_step(spec, retimed, weights, batch, t)["plan_s"]
                rows.append(row | plan_step(spec, profile, weights, batch, t))
    explain(rows)
    doc = {
        "what": "kvserve plan's decode step (the measured engine profile; the roofline beside it) "
        "vs kvserve bench latency's measured decode step (median), this machine, one sitting",
        "model": args.model,
        "commands": COMMANDS,
        "wall_s": time.time() - started,
        "probes": probes,
        "drift": drift(probes),
        "profile": profile.to_dict(),
        "tolerance": TOLERANCE,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print_table(rows)
    for key, d in doc["drift"].items():
        print(f"drift over the run: {key} max/min {d['max_over_min']:.3f}")
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
