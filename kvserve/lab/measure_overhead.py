"""The engine's per-step work outside the model's forward, timed on the real engine, for the
planner (docs/planning.md, "The engine outside the forward").

`kvserve plan --measure --measure-model MODEL` loads MODEL into the offline engine (`LLM`, the
public API `kvserve bench latency` times), runs `rows` greedy requests of `prompt_len` tokens
with `new_tokens` forced tokens, and times every decode step as `bench latency` does
(time.perf_counter around `next(LLM.generate_steps)`), with timers around the parts inside it:

- `forward`: `forward_chunks` (embedding, attention metadata, the layers, the head): the
  model's part, which the planner's weights, cache and host terms price;
- `engine-sample` (seconds per step): `ModelRunner._sample` (the sampler over the logits);
- `engine-runner`: `ModelRunner.execute` less the forward and the sampler (the runner's
  request states, the step's inputs, the output records);
- `engine-loop`: the timed step less `ModelRunner.execute` (the scheduler and its update,
  the engine's per-request bookkeeping, the output processor, `LLM`'s step generator).

Each is the median over the decode steps (every row decoding one token) of the per-step
differences, at each row count. The three add up to the measured step less the forward.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvserve.lab.plan.hardware import MeasuredPoint

OVERHEAD_ROWS = (1, 4, 16, 64)  # up to the fused step's rows
PARTS = ("engine-sample", "engine-runner", "engine-loop")


@contextmanager
def _timers(targets: list[tuple[object, str, str]], step: dict) -> Iterator[None]:
    """Wrap each (owner, attribute, key): its time is added to step[key]; restored on exit."""
    originals = []
    for owner, name, key in targets:
        original = getattr(owner, name)
        originals.append((owner, name, original, name in vars(owner)))

        def wrapper(*args, _original=original, _key=key, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                step[_key] += time.perf_counter() - start

        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original, own in reversed(originals):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def split_step(step_s: float, execute_s: float, forward_s: float, sample_s: float) -> dict:
    """One timed step's parts outside the forward (seconds): they sum to step_s - forward_s."""
    return {
        "engine-sample": sample_s,
        "engine-runner": execute_s - forward_s - sample_s,
        "engine-loop": step_s - execute_s,
    }


def overhead_points(steps_by_rows: dict[int, list[dict]]) -> list[MeasuredPoint]:
    """{rows: [split_step dicts]} -> per row count, the median of each part (MeasuredPoint
    kinds `engine-sample`, `engine-runner`, `engine-loop`; median_s = seconds per step)."""
    points = []
    for rows, steps in sorted(steps_by_rows.items()):
        if not steps:
            continue
        for part in PARTS:
            value = max(0.0, statistics.median(s[part] for s in steps))
            points.append(MeasuredPoint(part, rows, 0.0, 0.0, 0.0, value))
    return points


def measure_overhead(
    model_dir: str,
    rows: tuple[int, ...] = OVERHEAD_ROWS,
    prompt_len: int = 32,
    new_tokens: int = 16,
    iters: int = 2,
    quantization: str | None = None,
    progress: Callable[[MeasuredPoint], None] | None = None,
) -> list[MeasuredPoint]:
    """The engine-* points of `model_dir` on the offline engine (see the module docstring)."""
    import kvserve.runner.model_runner as runner_mod
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM
    from kvserve.lab.plan import arith, load_model

    # every row's prompt and output in the cache at once, twice over (block rounding): 64 rows of
    # 48 tokens of a 3B model's fp32 cache take ~0.7 GB, past a fixed 512 MiB, and the engine
    # would preempt instead of decoding every row
    per_token = arith.kv_bytes_per_token(load_model(model_dir), 4)
    cache = max(512 << 20, int(2 * max(rows) * (prompt_len + new_tokens + 16) * per_token))
    llm = LLM(
        model_dir,
        dtype="float32",
        max_num_seqs=max(rows),
        quantization=quantization,
        kv_cache_memory_bytes=cache,
    )
    runner = llm.engine.runner
    params = SamplingParams(
        max_tokens=new_tokens,
        min_tokens=new_tokens,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
    )
    vocab = llm.config.model.vocab_size
    by_rows: dict[int, list[dict]] = {}
    step: dict = defaultdict(float)
    targets = [
        (runner, "execute", "execute"),
        (runner, "_sample", "sample"),
        (runner_mod, "forward_chunks", "forward"),
    ]
    try:
        with _timers(targets, step):
            for n in rows:
                prompts = [
                    [(7 + 31 * i + 13 * j) % vocab for j in range(prompt_len)] for i in range(n)
                ]
                found = []
                for it in range(iters + 1):  # the first is a warm-up
                    llm.reset_prefix_cache()
                    steps = llm.generate_steps(prompts, params)
                    seen = set()
                    while True:
                        step.clear()
                        t0 = time.perf_counter()
                        changed = next(steps, None)
                        step_s = time.perf_counter() - t0
                        if changed is None:
                            break
                        decoding = len(changed) == n and seen >= set(changed)
                        seen |= set(changed)
                        if it and decoding and step["forward"] > 0:
                            found.append(
                                split_step(step_s, step["execute"], step["forward"], step["sample"])
                            )
                by_rows[n] = found
                if not found:  # said, not silently held at the last row count's values
                    warnings.warn(
                        f"no decode step ran all {n} rows: no engine-* points at {n}", stacklevel=2
                    )
                for p in overhead_points({n: found}):
                    if progress:
                        progress(p)
    finally:
        llm.engine.shutdown()
    return overhead_points(by_rows)
