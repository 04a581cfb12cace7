"""Where a batch-1 decode step goes: the fused layers, the LM head, the rest of the forward, the
sampler, the runner, the scheduler and the engine's output handling (time.perf_counter around each).

One greedy request of `--prompt-len` tokens and `--new-tokens` new tokens through `LLM.generate`
(the offline engine in this process, as `benchmarks/quant.py speed` runs it), after a warm-up.
Per decode step, in ms: `step` = `LLMEngine.step` (the whole loop body), `runner` =
`ModelRunner.execute`, `forward` = `forward_chunks` (embedding, metadata, layers, head), `fused` /
`head` the two native calls inside it, `sample` = `ModelRunner._sample`; what is left of `step`
outside `runner` is the scheduler, the detokenizer and the output processor. The prompt's
prefill step is reported on its own (`prefill_step`), not averaged into the decode steps.

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/step_profile.py \
        --formats "linear=int8,head=int8;linear=int4-g32,head=int8" [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


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
            steps[-1][key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


KEYS = ("step", "runner", "forward", "fused", "head", "sample")


def profile(fmt: str, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    import kvserve.runner.model_runner as runner_mod
    from kvserve import LLM, SamplingParams

    llm = LLM("/tmp/kv/smol-gpt2", quantization=None if fmt == "fp32" else fmt, max_num_seqs=4)
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    prompt = list(range(10, 10 + prompt_len))
    llm.generate([prompt], params.with_updates(max_tokens=8))  # warm-up (builds the fused step)
    steps: list = []
    _timed(engine, "step", "step", steps, opens_step=True)
    _timed(runner, "execute", "runner", steps)
    _timed(runner, "_sample", "sample", steps)
    _timed(runner_mod, "forward_chunks", "forward", steps)
    if model.fused is not None:
        _timed(type(model.fused), "__call__", "fused", steps)
    if model.cpu_head is not None:
        _timed(model.cpu_head, "forward", "head", steps)
    rows = []
    for _ in range(rounds):
        steps.clear()
        engine.kv_manager.pool.reset_prefix_cache()
        llm.generate([prompt], params)
        decode = [s for s in steps[1:] if s["runner"] > 0]  # steps[0] is the prompt's prefill
        row = {k: sum(s[k] for s in decode) / len(decode) * 1e3 for k in KEYS}
        row["prefill_step"] = steps[0]["step"] * 1e3
        row["outside_runner"] = row["step"] - row["runner"]
        row["runner_outside_forward_sample"] = row["runner"] - row["forward"] - row["sample"]
        row["forward_outside_fused_head"] = row["forward"] - row["fused"] - row["head"]
        row["decode_steps"] = len(decode)
        rows.append(row)
    return {"format": fmt, "rounds": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="linear=int8,head=int8;linear=int4-g32,head=int8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    report = []
    for fmt in args.formats.split(";"):
        result = profile(fmt, args.prompt_len, args.new_tokens, args.rounds)
        report.append(result)
        for row in result["rounds"]:
            print(fmt, " ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
