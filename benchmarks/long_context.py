"""Decode step time against context length, and cold vs warm prefix TTFT, through the public `LLM` API.

Batch 1, greedy, EOS ignored. For each context length C a random prompt of C tokens is prefilled and
`--new-tokens` are generated; the decode step is (last token - first token) / (n - 1). The goal
(docs/performance.md): the step at 4,000 tokens of context within 1.5x of the step at 128 (the KV bytes a
step reads alone make ~1.35x on SmolLM2-135M's shape).

TTFT: a `--ttft-prompt`-token prompt with the prefix cache reset (cold: the whole prompt is computed) and the
same prompt again (warm: all full blocks come from the prefix cache).

    .venv/bin/python benchmarks/long_context.py --model /tmp/kv/smol-gpt2 [--out FILE]
"""

from __future__ import annotations

import argparse

from _report import (  # benchmarks/ is on sys.path when a script runs
    kvserve_llm,
    threads_used,
    write_report,
)


def decode_step_s(llm, prompt: list[int], new_tokens: int) -> float:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.engine.kv_manager.pool.reset_prefix_cache()
    metrics = llm.generate([prompt], params)[0].outputs[0].metrics
    return (metrics.token_times[-1] - metrics.token_times[0]) / (new_tokens - 1)


def ttft_s(llm, prompt: list[int], reset: bool) -> float:
    from kvserve import SamplingParams

    if reset:
        llm.engine.kv_manager.pool.reset_prefix_cache()
    output = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return output.outputs[0].metrics.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/kv/smol-gpt2")
    parser.add_argument("--contexts", default="128,1000,2000,4000")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ttft-prompt", type=int, default=3000)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", default="benchmarks/results/long_context.json")
    args = parser.parse_args()

    LLM = kvserve_llm()  # before torch: kvserve's thread defaults apply as they do for users
    import torch

    contexts = [int(c) for c in args.contexts.split(",")]
    options = {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}
    llm = LLM(
        args.model,
        max_model_len=max(contexts + [args.ttft_prompt]) + args.new_tokens + 16,
        kv_cache_memory_bytes=512 * 1024**2,
        **options,
    )
    vocab = llm.engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    decode_step_s(llm, torch.randint(3, vocab, (64,), generator=gen).tolist(), 4)  # warm-up
    rows = []
    for context in contexts:
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        step_s = decode_step_s(llm, prompt, args.new_tokens)
        rows.append({"context": context, "decode_step_ms": step_s * 1e3})
        print(f"context {context:5d}: decode step {step_s * 1e3:6.2f} ms", flush=True)
    for row in rows:
        row["vs_first"] = row["decode_step_ms"] / rows[0]["decode_step_ms"]
    prompt = torch.randint(3, vocab, (args.ttft_prompt,), generator=gen).tolist()
    cold = ttft_s(llm, prompt, reset=True)
    warm = ttft_s(llm, prompt, reset=False)
    print(
        f"TTFT {args.ttft_prompt} tokens: cold {cold * 1e3:.0f} ms "
        f"({args.ttft_prompt / cold:.0f} tok/s), warm {warm * 1e3:.1f} ms (x{cold / warm:.0f})"
    )
    report = {
        "kvserve_threads": threads_used(),
        "benchmark": "long_context",
        "model": args.model,
        "kv_cache_dtype": args.kv_cache_dtype,
        "new_tokens": args.new_tokens,
        "torch_threads": torch.get_num_threads(),
        "decode": rows,
        "ttft": {
            "prompt_tokens": args.ttft_prompt,
            "cold_s": cold,
            "cold_prefill_tok_s": args.ttft_prompt / cold,
            "warm_s": warm,
            "cold_over_warm": cold / warm,
        },
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
