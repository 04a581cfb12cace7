"""Decode throughput through the engine (`LLM`) with tensor parallelism on CPU: TP=2 (rank 0 in
this process and one gloo worker, one thread per rank) against TP=1 with two threads, at batch 1
and 16, and the share of a TP=2 step that rank 0 spends inside collectives (the 2 L + 1
all-reduces and the logits gather, waiting for the other rank included). docs/parallel.md.

The model is /tmp/kv/smol-gpt2's tensors under a config that splits 2 ways: SmolLM2-135M has 9
query heads and 3 KV heads, which 2 ranks cannot divide, so the same q/k/v tensors are read as 6
heads of 96 and 2 KV heads of 96 (the same parameters, FLOPs and KV bytes per token; only the
grouping of the projection rows into heads differs). Rounds alternate A B A B; each round starts a
fresh engine.

    kv-bench python benchmarks/tensor_parallel_engine.py \\
        --out benchmarks/results/tensor_parallel_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLIT_CONFIG = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=96)


def split_model_dir(source: Path, target: Path) -> Path:
    """`source`'s files (linked) with SPLIT_CONFIG over its config.json."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        link = target / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | SPLIT_CONFIG, indent=2))
    return target


def timed_collectives(totals: dict) -> None:
    """Count and time every collective rank 0 runs (kvserve.model.parallel calls them through
    torch.distributed at call time)."""
    import torch.distributed as dist

    for name in ("all_reduce", "gather", "all_gather"):
        original = getattr(dist, name)

        def timed(*args, _original=original, **kwargs):
            t0 = time.perf_counter()
            out = _original(*args, **kwargs)
            totals["comm_s"] += time.perf_counter() - t0
            totals["num_collectives"] += 1
            return out

        setattr(dist, name, timed)


def decode_run(llm, batch: int, context: int, num_steps: int, num_warmup: int, totals: dict):
    from kvserve import SamplingParams

    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=num_steps + num_warmup + 2, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(50000) for _ in range(context)], params)
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    while any(not t for t in tokens.values()):  # prefill (chunks of the token budget)
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    for _ in range(num_warmup):
        engine.step()
    step_s = []
    totals.update(comm_s=0.0, num_collectives=0)
    for _ in range(num_steps):
        t0 = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - t0)
        assert len(outs) == batch, "every request decodes one token a step"
        for out in outs:
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    for request_id in ids:
        engine.abort_request(request_id)
    median = statistics.median(step_s)
    return {
        "batch": batch,
        "step_ms_median": median * 1e3,
        "decode_tok_s": batch / median,
        "comm_ms_per_step": totals["comm_s"] / num_steps * 1e3,
        "comm_share": totals["comm_s"] / sum(step_s),
        "collectives_per_step": totals["num_collectives"] / num_steps,
        "tokens_first_request": tokens[ids[0]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/kv/smol-gpt2")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--num-steps", type=int, default=16)
    parser.add_argument("--num-warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel_engine.json")
    args = parser.parse_args()

    from kvserve import LLM

    model_dir = split_model_dir(Path(args.model), Path("/tmp/kv") / "smol-gpt2-split2")
    batches = [int(b) for b in args.batches.split(",")]
    totals = {"comm_s": 0.0, "num_collectives": 0}
    timed_collectives(totals)
    options = dict(max_model_len=512, max_num_seqs=max(batches), kv_cache_memory_bytes=256 << 20)
    rows = []
    for round_index in range(args.rounds):
        for tp in (1, 2):
            if tp == 1:
                torch.set_num_threads(2)
            start = time.perf_counter()
            llm = LLM(str(model_dir), tensor_parallel_size=tp, **options)
            load_s = time.perf_counter() - start
            threads = torch.get_num_threads()
            try:
                for batch in batches:
                    row = decode_run(
                        llm, batch, args.context, args.num_steps, args.num_warmup, totals
                    )
                    row.update(round=round_index, tensor_parallel_size=tp, threads_per_rank=threads)
                    row["engine_start_s"] = load_s
                    rows.append(row)
                    print(
                        f"round {round_index} TP={tp} ({threads} thread(s)/rank) B={batch}: "
                        f"{row['step_ms_median']:.1f} ms/step, {row['decode_tok_s']:.1f} tok/s, "
                        f"collectives {row['comm_ms_per_step']:.1f} ms/step "
                        f"({row['comm_share']:.0%}, {row['collectives_per_step']:.0f} calls)",
                        flush=True,
                    )
            finally:
                llm.engine.shutdown()
    first = {}
    for r in rows:
        first.setdefault(r["batch"], r["tokens_first_request"])
    same = all(r["tokens_first_request"] == first[r["batch"]] for r in rows)
    result = {
        "benchmark": "tensor_parallel_engine",
        "command": " ".join(sys.argv),
        "model": str(model_dir),
        "split_config": SPLIT_CONFIG,
        "context_tokens": args.context,
        "num_steps": args.num_steps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "greedy_tokens_identical_across_layouts": same,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"greedy tokens identical across layouts: {same}; wrote {args.out}")


if __name__ == "__main__":
    main()
