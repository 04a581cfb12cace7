"""What a serving step costs by its composition, offline on one model: decode rows only, a prompt
chunk only, and a prompt chunk beside decoding rows (the steps that stall decoding while serving).

Each composition is built in the offline engine (`LLM`, kvserve imported before torch, so its
thread defaults apply) and its `engine.step()` timed: `--decode-rows` requests decoding, then one
request of `--prompt-tokens` prompt tokens added (its prompt is the chunk; the step budget is the
engine's `max_num_batched_tokens`, default or `--budget`). Inside each step, per step in ms: `linear`
(every linear module's forward outside the fused step: the GEMMs), `fused` (the fused decode step,
one native call for all layers of a decode-rows-only step), `head` (the LM head), `sample` (the
runner's sampler), `schedule` + `update` (the scheduler), and `host_rest` (the step less all of
these: attention, norms, RoPE and KV writes on the per-op path, tensors, output handling).

    flock /tmp/kvserve-bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/serving_steps.py \
        --decode-rows 0 1 4 16 --prompt-tokens 0 32 64 128 --repeats 5 --out steps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import kvserve_llm  # noqa: E402

KEYS = ("step", "schedule", "update", "linear", "fused", "head", "sample")


class Recorder:
    """Adds each wrapped call's time to the open record; nested calls of one key count once."""

    def __init__(self) -> None:
        self.record: defaultdict[str, float] | None = None
        self._depth: defaultdict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            # nested calls of one key, and the head's own linear (counted as `head`), once
            if self.record is None or self._depth[key] or (key == "linear" and self._depth["head"]):
                return original(*args, **kwargs)
            self._depth[key] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[key] -= 1
                self.record[key] += time.perf_counter() - start

        setattr(owner, name, wrapper)


def instrument(llm, recorder: Recorder) -> None:
    from kvserve.model.block_linear import BlockLinear
    from kvserve.model.linear import PackedLinear, TransposedLinear
    from kvserve.model.qlinear import QuantLinear

    engine = llm.engine
    runner = engine.runner
    model = runner.model
    for cls in (BlockLinear, PackedLinear, TransposedLinear, QuantLinear):
        recorder.wrap(cls, "forward", "linear")
    recorder.wrap(engine.scheduler, "schedule", "schedule")
    recorder.wrap(engine.scheduler, "update", "update")
    recorder.wrap(runner, "_sample", "sample")
    recorder.wrap(model, "compute_logits", "head")
    fused_decode = sys.modules["kvserve.model.fused_decode"]
    recorder.wrap(fused_decode.FusedDecoder, "__call__", "fused")


def timed_step(llm, recorder: Recorder) -> dict:
    recorder.record = defaultdict(float)
    start = time.perf_counter()
    llm.engine.step()
    recorder.record["step"] = time.perf_counter() - start
    record, recorder.record = recorder.record, None
    return dict(record)


def measure(llm, recorder, decode_rows: int, prompt_tokens: int, repeats: int, seq: list) -> list:
    from kvserve import SamplingParams

    engine = llm.engine
    long = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        seq[0] += 1
        return [(seq[0] * 7919 + i * 31) % 40000 + 100 for i in range(n)]

    ids = []
    for _ in range(decode_rows):
        seq[0] += 1
        ids.append(f"d{seq[0]}")
        engine.add_request(ids[-1], prompt(128), long)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # every row past its prompt, the fused step built
        engine.step()
    rows = []
    for _ in range(repeats):
        if prompt_tokens:
            seq[0] += 1
            new_id = f"p{seq[0]}"
            engine.add_request(new_id, prompt(prompt_tokens), long)
        if not prompt_tokens and not decode_rows:
            break
        rows.append(timed_step(llm, recorder))
        if prompt_tokens:
            engine.abort_request(new_id)
    for request_id in ids:
        engine.abort_request(request_id)
    return rows


def summarise(rows: list[dict]) -> dict:
    out = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in KEYS}
    out["host_rest"] = out["step"] - sum(out[k] for k in KEYS[1:])
    out["step_min"] = min(r["step"] for r in rows) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: kvserve's default model")
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[0, 32, 64, 128])
    parser.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gguf-activations", default=None, help="fp32 (the default) or int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm_cls = kvserve_llm()
    import torch

    torch.set_num_threads(args.threads)
    options = {"enable_prefix_caching": False, "max_num_seqs": 64, "thread_policy": "fixed"}
    if args.budget:
        options["max_num_batched_tokens"] = args.budget
    if args.gguf_activations:
        options["gguf_activations"] = args.gguf_activations
    llm = llm_cls(args.model, **options)
    recorder = Recorder()
    instrument(llm, recorder)
    seq = [0]
    measure(llm, recorder, 4, 128, 2, seq)  # warm-up
    report = []
    for decode_rows in args.decode_rows:
        for prompt_tokens in args.prompt_tokens:
            rows = measure(llm, recorder, decode_rows, prompt_tokens, args.repeats, seq)
            if not rows:
                continue
            row = {"decode_rows": decode_rows, "prompt_tokens": prompt_tokens} | summarise(rows)
            report.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)  # fmt: skip
    if args.out:
        doc = {"threads": args.threads, "options": options, "rows": report}
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
