"""Where a decode step goes: the fused layers, the LM head, the rest of the forward, the sampler,
the runner, the scheduler and the engine's output handling (time.perf_counter around each).

`--batch` greedy requests of `--prompt-len` tokens and `--new-tokens` new tokens through
`LLM.generate` (the offline engine in this process, as `benchmarks/quant.py speed` runs it: kvserve
imported before torch, so its thread defaults apply), after a warm-up of the same shape. Per decode
step, in ms: `step` = `EngineCore.step` (the whole loop body); inside it `schedule` and `update`
(the scheduler), `runner` = `ModelRunner.execute`, `outputs` (`OutputProcessor.process`: the
snapshots) and `detok` (incremental detokenisation); inside the runner `forward` = `forward_chunks`
(`metadata` = attention metadata, `fused` / `head` the two native calls), `sample` =
`ModelRunner._sample` (`sampling_batch` = its tensors, `sampler` = `Sampler.__call__`). Derived:
`host` = `step` - `fused` - `head`, everything a step does outside the two native calls. The
steps that hold prompt tokens are reported on their own (`prefill_step`, their mean, and
`prefill_steps`, how many: a batch's prompts past the step budget take several), not averaged into
the decode steps.

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/step_profile.py \
        --formats "linear=int8,head=int8;linear=int4-g32,head=int8" [--batch 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import kvserve_llm  # noqa: E402  (benchmarks/ on sys.path, as when a script runs)


def _timed(owner, name: str, key: str, steps: list, opens_step: bool = False) -> None:
    """Wrap owner.name: its time is added to steps[-1][key]; `opens_step` starts a new record."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if opens_step:
            steps.append(defaultdict(float))
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if steps:
                steps[-1][key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


KEYS = ("step", "schedule", "update", "runner", "forward", "metadata", "fused", "head", "sample",
        "sampling_batch", "sampler", "outputs", "detok")  # fmt: skip


def profile(
    llm_cls,
    fmt: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    rounds: int,
    model: str = "/tmp/kv/smol-gpt2",
    stop: tuple[str, ...] = (),
) -> dict:
    import kvserve.engine.detokenizer as detok_mod
    import kvserve.engine.output_processor as outputs_mod
    import kvserve.runner.forward as forward_mod
    import kvserve.runner.model_runner as runner_mod
    import kvserve.runner.sampler as sampler_mod
    from kvserve import SamplingParams

    quant = None if fmt == "fp32" else fmt
    llm = llm_cls(model, quantization=quant, max_num_seqs=max(4, batch))
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True, stop=stop)
    prompts = [list(range(10 + i, 10 + i + prompt_len)) for i in range(batch)]
    llm.generate(prompts, params)  # warm-up of the same shape (builds the fused step)
    steps: list = []
    _timed(engine, "step", "step", steps, opens_step=True)
    _timed(engine.scheduler, "schedule", "schedule", steps)
    _timed(engine.scheduler, "update", "update", steps)
    _timed(runner, "execute", "runner", steps)
    execute = runner.execute

    def shaped(scheduler_output):  # which steps hold prompt tokens (a prefill may take several)
        steps[-1]["prompt_tokens"] += sum(
            c.num_tokens for c in scheduler_output.chunks if not c.num_output_tokens
        )
        return execute(scheduler_output)

    runner.execute = shaped
    _timed(runner, "_sample", "sample", steps)
    _timed(runner_mod, "build_sampling_batch", "sampling_batch", steps)
    _timed(sampler_mod.Sampler, "__call__", "sampler", steps)
    _timed(runner_mod, "forward_chunks", "forward", steps)
    _timed(forward_mod, "build_attention_metadata", "metadata", steps)
    _timed(outputs_mod.OutputProcessor, "process", "outputs", steps)
    _timed(detok_mod.IncrementalDetokenizer, "update", "detok", steps)
    if model.fused is not None:
        _timed(type(model.fused), "__call__", "fused", steps)
    if model.cpu_head is not None:
        _timed(model.cpu_head, "forward", "head", steps)
    rows = []
    for _ in range(rounds):
        steps.clear()
        engine.kv_manager.pool.reset_prefix_cache()
        llm.generate(prompts, params)
        decode = [s for s in steps if s["runner"] > 0 and not s["prompt_tokens"]]
        prefill = [s for s in steps if s["prompt_tokens"]]
        row = {k: sum(s[k] for s in decode) / len(decode) * 1e3 for k in KEYS}
        row["prefill_step"] = sum(s["step"] for s in prefill) / len(prefill) * 1e3
        row["prefill_steps"] = len(prefill)
        row["host"] = row["step"] - row["fused"] - row["head"]
        row["outside_runner"] = row["step"] - row["runner"]
        row["runner_outside_forward_sample"] = row["runner"] - row["forward"] - row["sample"]
        row["forward_outside_fused_head"] = row["forward"] - row["fused"] - row["head"]
        row["decode_steps"] = len(decode)
        rows.append(row)
    del llm
    return {"format": fmt, "batch": batch, "rounds": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="linear=int8,head=int8;linear=int4-g32,head=int8")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="/tmp/kv/smol-gpt2", help="a checkpoint or GGUF file")
    parser.add_argument(
        "--stop", nargs="*", default=[], help="stop strings every request carries (never matched)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm_cls = kvserve_llm()  # before torch: kvserve's thread defaults apply, as in quant.py
    import torch

    torch.set_num_threads(args.threads)
    report = []
    for fmt in args.formats.split(";"):
        for batch in args.batch:
            result = profile(
                llm_cls,
                fmt,
                batch,
                args.prompt_len,
                args.new_tokens,
                args.rounds,
                args.model,
                tuple(args.stop),
            )
            report.append(result)
            for row in result["rounds"]:
                print(f"{fmt} b{batch}", " ".join(f"{k}={v:.3f}" for k, v in row.items()),
                      flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
