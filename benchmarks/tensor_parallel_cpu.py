"""Decode steps of the tensor-parallel model layers on CPU: TP=1 with T threads against TP=T ranks of
one thread each over gloo on 127.0.0.1, and the all-reduce / all-gather share of a TP step.

It times the model forward (`kvserve.runner.forward.forward_chunks`) of decode steps, not the
engine: the engine does not start tensor-parallel workers yet (docs/parallel.md). Rounds alternate
A B A B; each configuration runs in fresh processes.

    kv-bench python benchmarks/tensor_parallel_cpu.py --out benchmarks/results/tensor_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.tensor_parallel_engine import timed_collectives  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

# Even head counts so 2 ranks split them: ~180M parameters, 0.7 GB in fp32.
SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
)
VOCAB = 32000
BLOCK = 16


def _rank_main(rank: int, world: int, port: int, cfg: dict, out_path: str) -> None:
    import torch.distributed as dist

    from kvserve.config import ModelConfig
    from kvserve.model.attention import get_attention_backend
    from kvserve.model.parallel import load_tensor_parallel_model
    from kvserve.runner.forward import allocate_kv_cache, forward_chunks

    torch.set_num_threads(cfg["threads"])
    totals = {"comm_s": 0.0, "num_collectives": 0}
    if world > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            GLOO_SOCKET_IFNAME="lo",
        )
        dist.init_process_group("gloo", init_method="env://")
        timed_collectives(totals)
    model_dir = Path(cfg["model_dir"])
    config = ModelConfig.from_dir(model_dir)
    model = load_tensor_parallel_model(model_dir, config, 4096, rank, world)
    batch, context = cfg["batch"], cfg["context"]
    blocks_per_seq = -(-(context + cfg["steps"] + cfg["warmup"] + 1) // BLOCK)
    _, kv = allocate_kv_cache(
        model, batch * blocks_per_seq, BLOCK, torch.float32, torch.device("cpu")
    )
    attention = get_attention_backend("torch", torch.device("cpu"), torch.float32)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompt = [(7 * i + 3) % VOCAB for i in range(context)]
    with torch.no_grad():
        for table in tables:  # prefill, untimed
            forward_chunks(model, kv, attention, [(0, prompt, table)], BLOCK, "cpu", [context - 1])
        step_s, comm_s = [], []
        tokens = [11] * batch
        for i in range(cfg["warmup"] + cfg["steps"]):
            chunks = [(context + i, [tokens[b]], tables[b]) for b in range(batch)]
            totals["comm_s"] = 0.0
            t0 = time.perf_counter()
            logits = forward_chunks(model, kv, attention, chunks, BLOCK, "cpu", None)
            elapsed = time.perf_counter() - t0
            tokens = logits.argmax(-1).tolist()
            if i >= cfg["warmup"]:
                step_s.append(elapsed)
                comm_s.append(totals["comm_s"])
    allreduce_s = None
    if world > 1:
        # the bare collective: a decode step's [B, hidden] all-reduce, many times, no model between
        x = torch.zeros(batch, config.hidden_size)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg["num_bare"]):
            dist.all_reduce(x)
        allreduce_s = (time.perf_counter() - t0) / cfg["num_bare"]
        dist.destroy_process_group()
    if rank == 0:
        torch.save(
            {"step_s": step_s, "comm_s": comm_s, "tokens": tokens, "allreduce_s": allreduce_s},
            out_path,
        )


def run_config(world: int, threads: int, batch: int, args, model_dir: Path, tmp: Path) -> dict:
    import torch.multiprocessing as mp

    cfg = dict(
        threads=threads,
        model_dir=str(model_dir),
        batch=batch,
        context=args.context,
        steps=args.steps,
        warmup=args.warmup,
        num_bare=200,
    )
    out = tmp / f"w{world}-b{batch}.pt"
    mp.spawn(_rank_main, args=(world, free_port(), cfg, str(out)), nprocs=world, join=True)
    result = torch.load(out)
    step = statistics.median(result["step_s"])
    comm = statistics.median(result["comm_s"])
    return {
        "tensor_parallel": world,
        "threads_per_rank": threads,
        "batch": batch,
        "median_step_s": step,
        "decode_tokens_per_s": batch / step,
        "median_comm_s": comm,
        "comm_share": comm / step,
        "num_collectives_per_step": 2 * 12 + 2 if world > 1 else 0,
        "bare_allreduce_s": result["allreduce_s"],
        "last_tokens": result["tokens"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/kv/tp-bench-llama"))
    p.add_argument("--threads", type=int, default=2, help="cores: TP=1 threads = TP ranks")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not (args.model_dir / "config.json").is_file():
        from tests.checkpoints import build_checkpoint

        print(f"building a random {SHAPE} checkpoint at {args.model_dir}")
        build_checkpoint(args.model_dir, "llama", vocab_size=VOCAB, **SHAPE)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for batch in (int(b) for b in args.batch.split(",")):
                for world, threads in ((1, args.threads), (args.threads, 1)):  # A B A B
                    row = run_config(world, threads, batch, args, args.model_dir, Path(tmp))
                    rows.append(row | {"round": round_index})
                    print(
                        f"round {round_index} TP={world} x {threads} thread(s) B={batch}: "
                        f"step {row['median_step_s'] * 1e3:.1f} ms, "
                        f"{row['decode_tokens_per_s']:.1f} tok/s, collectives "
                        f"{row['median_comm_s'] * 1e3:.2f} ms ({row['comm_share']:.1%}); bare "
                        f"all-reduce {(row['bare_allreduce_s'] or 0) * 1e6:.0f} us",
                        flush=True,
                    )
    same = all(
        r["last_tokens"] == s["last_tokens"] for r in rows for s in rows if r["batch"] == s["batch"]
    )
    print(f"greedy tokens identical across TP=1 and TP={args.threads}: {same}")
    if args.out:
        from benchmarks._report import write_report

        write_report(
            args.out,
            {
                "what": "decode steps of the tensor-parallel model layers (forward only)",
                "shape": SHAPE | {"vocab_size": VOCAB, "dtype": "float32"},
                "context": args.context,
                "steps": args.steps,
                "rows": rows,
                "greedy_tokens_identical": same,
            },
        )


if __name__ == "__main__":
    main()
