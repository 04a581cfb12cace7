"""Decode throughput: kvserve vs transformers `generate` on the same random SmolLM2-135M-shaped checkpoint.

Greedy, a fixed prompt per sequence, 128 new tokens with EOS ignored; batch 1 and batch 16; output tokens/s
= batch x new tokens / wall time of the whole generate call (prefill included, the same for both). Both
engines must produce identical tokens first (docs/load-tests.md: a speed claim needs equal work).

    .venv/bin/python benchmarks/decode.py [--out benchmarks/results/decode.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _report import write_report  # benchmarks/ is on sys.path when a script runs

SMOLLM2_135M_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
)


def build(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_SHAPE, initializer_range=0.05)).eval()
    model.save_pretrained(path)
    return model


def time_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
        elapsed = time.perf_counter() - start
    return elapsed, out[:, ids.shape[1] :].tolist()


def time_kvserve(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.engine.kv_manager.pool.reset_prefix_cache()  # no cross-run cache hits
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per point; best is kept")
    args = parser.parse_args()

    from kvserve import LLM

    with tempfile.TemporaryDirectory() as tmp:
        hf_model = build(Path(tmp))
        llm = LLM(tmp, max_num_seqs=64, kv_cache_memory_bytes=256 * 1024**2)
        results = []
        for batch in [int(b) for b in args.batches.split(",")]:
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(3, 49152, (batch, args.prompt_len), generator=gen).tolist()
            time_kvserve(llm, prompts[:1], 4)  # warm-up
            time_hf(hf_model, prompts[:1], 4)
            row = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
            for name, fn, engine in (
                ("kvserve", time_kvserve, llm),
                ("transformers", time_hf, hf_model),
            ):
                times, tokens = [], None
                for _ in range(args.repeats):
                    elapsed, tokens = fn(engine, prompts, args.new_tokens)
                    times.append(elapsed)
                row[name] = {
                    "best_s": min(times),
                    "times_s": times,
                    "output_tokens_per_s": batch * args.new_tokens / min(times),
                    "tokens": tokens,
                }
            same = row["kvserve"]["tokens"] == row["transformers"]["tokens"]
            row["identical_tokens"] = same
            row["speedup"] = (
                row["kvserve"]["output_tokens_per_s"] / row["transformers"]["output_tokens_per_s"]
            )
            for name in ("kvserve", "transformers"):
                del row[name]["tokens"]
            results.append(row)
            print(
                f"batch {batch:3d}: kvserve {row['kvserve']['output_tokens_per_s']:8.1f} tok/s, "
                f"transformers {row['transformers']['output_tokens_per_s']:8.1f} tok/s, "
                f"x{row['speedup']:.2f}, identical tokens: {same}"
            )
    report = {
        "benchmark": "decode",
        "model": "random Llama with SmolLM2-135M's shape (fp32)",
        "shape": SMOLLM2_135M_SHAPE,
        "dtype": "float32",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
