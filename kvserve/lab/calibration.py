"""Calibrate the simulator on the real engine: time engine steps, fit a per-step cost model.

This module sits above both the engine and the simulator (design.md: the engine never imports
`sim`, and `sim` never imports the model or the runner), beside `kvserve simulate`.

The engine runs a designed sweep: batches of 1 .. max_num_seqs requests at a short and a long
prompt length (decode steps at many batch sizes and contexts, prompt chunks of many sizes), then
staggered arrivals that mix prompt chunks into decode steps. Every `EngineCore.step()` is timed
whole (schedule + forward + sample + update + detokenise: one iteration of the serving loop), and
its `SchedulerOutput` is read from `EngineCore.last_scheduler_output` (the scheduler
itself is untouched). `kvserve.lab.sim.fit.fit_profile` fits the step costs; the profile records
the engine configuration so the simulator runs the same cache and limits by default.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.core import EngineCore
from kvserve.lab.sim.cost import FEATURES, StepLoad, StepProfile, feature_vector
from kvserve.lab.sim.fit import FitBound, fit_profile, judge_fit

WARMUP_STEPS = 8


class StepRecorder:
    """Times `engine.step()` and keeps each non-empty step's load with its wall time."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.loads: list[StepLoad] = []
        self.times_s: list[float] = []

    def step(self, keep: bool = True) -> None:
        start = time.perf_counter()
        self.engine.step()
        wall_s = time.perf_counter() - start
        last = self.engine.last_scheduler_output
        if keep and last is not None and not last.empty:
            self.loads.append(StepLoad.of(last))
            self.times_s.append(wall_s)

    def drain(self, keep: bool = True) -> None:
        while self.engine.has_unfinished_requests():
            self.step(keep)


class _Requests:
    """Random-token requests that run to exactly max_tokens."""

    def __init__(self, engine: EngineCore, seed: int) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.count = 0
        self.eos = engine.eos_token_ids

    def add(self, num_prompt: int, num_output: int) -> None:
        vocab = self.engine.config.model.vocab_size
        ids = [int(t) for t in self.rng.integers(0, vocab, size=num_prompt)]
        params = SamplingParams(max_tokens=num_output, ignore_eos=True, temperature=0.0)
        self.engine.add_request(f"calib-{self.count}", ids, params)
        self.count += 1


def _batches(rec: StepRecorder, reqs: _Requests, sizes: list[int], max_prompt: int) -> None:
    """Batches of every size at a short and a long prompt: decode steps at many batch sizes and
    contexts, prompt chunks of many sizes."""
    for batch in sizes:
        for prompt in (max(2, max_prompt // 8), max_prompt):
            for _ in range(batch):
                reqs.add(int(reqs.rng.integers(prompt // 2, prompt + 1)), 24)
            rec.drain()


def _staggered(rec: StepRecorder, reqs: _Requests, num: int, max_prompt: int) -> None:
    """Prompts joining running decodes a few steps apart (mixed steps), as in serving."""
    added = 0
    while added < num:
        for _ in range(int(reqs.rng.integers(1, 4))):
            reqs.add(int(reqs.rng.integers(2, max_prompt + 1)), int(reqs.rng.integers(8, 48)))
            added += 1
        for _ in range(int(reqs.rng.integers(2, 8))):
            if rec.engine.has_unfinished_requests():
                rec.step()
    rec.drain()


def run_sweep(
    engine: EngineCore,
    max_len: int,
    budget_s: float = 120.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> StepRecorder:
    """Repeat the designed sweep (batches, then staggered arrivals) while `budget_s` lasts, at
    least once; repeats average out a noisy machine. Returns the timed steps."""
    rec = StepRecorder(engine)
    reqs = _Requests(engine, seed)
    limits = engine.config.scheduler
    max_prompt = max(2, min(max_len, limits.max_model_len) - 48 - 1)
    # Warm-up: allocation and first-call costs, not kept.
    reqs.add(min(64, max_prompt), WARMUP_STEPS)
    rec.drain(keep=False)
    start = time.monotonic()
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= limits.max_num_seqs]
    rounds = 0
    while True:
        _batches(rec, reqs, sizes, max_prompt)
        _staggered(rec, reqs, 2 * max(sizes), max_prompt)
        rounds += 1
        if progress:
            elapsed = time.monotonic() - start
            progress(f"round {rounds}: {len(rec.times_s)} steps in {elapsed:.1f}s")
        if (time.monotonic() - start) * (rounds + 1) / rounds > budget_s:  # one more would overrun
            break
    return rec


def engine_meta(engine: EngineCore) -> dict[str, Any]:
    c = engine.config
    return {
        "model_dir": str(Path(c.model_dir).resolve()),
        "model_type": c.model.model_type,
        "num_layers": c.model.num_layers,
        "hidden_size": c.model.hidden_size,
        "dtype": c.dtype,
        # weight format of a quantised engine (an engine without the option: None)
        "quantization": getattr(c, "quantization", None),
        "device": c.device,
        "num_blocks": engine.num_blocks,
        "block_size": c.cache.block_size,
        "max_model_len": c.scheduler.max_model_len,
        "max_num_seqs": c.scheduler.max_num_seqs,
        "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
        "enable_prefix_caching": c.cache.enable_prefix_caching,
        "admission": c.scheduler.admission,
    }


def calibrate(
    engine: EngineCore,
    max_len: int = 1024,
    budget_s: float = 120.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> StepProfile:
    import torch

    rec = run_sweep(engine, max_len, budget_s, seed, progress)
    all_features = tuple(FEATURES)
    meta = {
        "engine": engine_meta(engine),
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "node": platform.node(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "samples": {
            "features": list(all_features),
            "rows": [feature_vector(s, all_features) for s in rec.loads],
            "wall_s": rec.times_s,
        },
    }
    return fit_profile(rec.loads, rec.times_s, meta=meta)


def calibrate_main(args: Any) -> str:
    """`kvserve simulate --calibrate MODEL_DIR`: build the engine as `kvserve serve` would with the
    given limits, calibrate, save; returns the profile path."""
    import sys

    from kvserve.engine.args import build_engine_config

    options = {
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs or SchedulerConfig.max_num_seqs,
        "max_num_batched_tokens": args.chunk_tokens or SchedulerConfig.max_num_batched_tokens,
        "block_size": args.block_size or CacheConfig.block_size,
        "num_blocks": args.num_blocks,
        "enable_prefix_caching": not args.no_prefix_caching,
    }
    quantization = getattr(args, "quantization", None)
    if quantization:
        options["quantization"] = quantization
    if args.kv_cache_gb is not None:
        options["kv_cache_memory_bytes"] = int(args.kv_cache_gb * 1e9)
    engine = EngineCore(build_engine_config(args.calibrate, **options))
    out = sys.stderr if args.json else sys.stdout
    print(
        f"calibrating on {args.calibrate} ({engine.config.device}, {engine.config.dtype}"
        + (f", {quantization}" if quantization else "")
        + ")",
        file=out,
    )
    profile = calibrate(
        engine,
        max_len=args.calibrate_max_len,
        budget_s=args.calibrate_budget_s,
        seed=args.seed,
        progress=lambda msg: print("  " + msg, file=out, flush=True),
    )
    bound = FitBound(args.max_fit_error, args.max_fit_p90_error)
    fit = profile.meta["fit"]
    coef = ", ".join(f"{f}={c:.3g}" for f, c in zip(profile.features, profile.coef_s, strict=True))
    print(
        f"fit over {fit['num_steps']} steps: median |rel err| {fit['median_abs_rel_error']:.1%}, "
        f"p90 {fit['p90_abs_rel_error']:.1%} (bounds {bound.max_median_abs_rel_error:.0%}, "
        f"{bound.max_p90_abs_rel_error:.0%}); seconds per unit: {coef}",
        file=out,
    )
    bad = judge_fit(profile, bound, args.accept_poor_fit)  # raises PoorFitError unless accepted
    path = profile.save(args.save)
    if bad:
        print(
            f"WARNING: POOR FIT ({'; '.join(bad)}), saved anyway (--accept-poor-fit) and marked "
            f"poor in {path}: every simulated latency inherits this error",
            file=sys.stderr,
        )
    print(f"saved to {path}", file=out)
    return str(path)
