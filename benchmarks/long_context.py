"""Decode step time against context length, and cold vs warm prefix TTFT, through the public `LLM` API.

Batch 1, greedy, EOS ignored. For each context length C a random prompt of C tokens is prefilled and
`--new-tokens` are generated; the decode step is (last token - first token) / (n - 1). The goal
(docs/performance.md): the step at 4,000 tokens of context within 1.5x of the step at 128 (the KV bytes a
step reads alone make ~1.35x on SmolLM2-135M's shape).

TTFT: a `--ttft-prompt`-token prompt with the prefix cache reset (cold: the whole prompt is computed) and the
same prompt again (warm: all full blocks come from the prefix cache).

    .venv/bin/python benchmarks/long_context.py --model /tmp/kv/smol-gpt2 [--rounds 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics

from _report import (  # benchmarks/ is on sys.path when a script runs
    kvserve_llm,
    threads_used,
    write_report,
)


def decode_step_s(llm, prompt: list[int], new_tokens: int, reset: bool = True) -> float:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    if reset:  # else a repeated prompt's full blocks come from the prefix cache: the same KV
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
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every context this many times, in alternating order (first to last, then "
        "back); each round's ratio to the first context is paired within the round",
    )
    parser.add_argument("--out", default="benchmarks/results/long_context.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

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
    prompts = {c: torch.randint(3, vocab, (c,), generator=gen).tolist() for c in contexts}
    samples: dict[int, list[float]] = {c: [] for c in contexts}  # ms per decode step, per round
    for r in range(args.rounds):
        # alternate the order so that a drift of the machine's speed biases no context; the first
        # round computes every prompt cold, later rounds keep what the prefix cache holds (the
        # decode step reads the same KV either way)
        for context in contexts if r % 2 == 0 else contexts[::-1]:
            step_s = decode_step_s(llm, prompts[context], args.new_tokens, reset=r == 0)
            samples[context].append(step_s * 1e3)
            print(
                f"round {r}: context {context:5d}: decode step {step_s * 1e3:6.2f} ms", flush=True
            )
    first = contexts[0]
    rows = []
    for context in contexts:
        ratios = sorted(a / b for a, b in zip(samples[context], samples[first], strict=True))
        rows.append({
            "context": context,
            "decode_step_ms": statistics.median(samples[context]),
            "decode_step_ms_rounds": samples[context],
            "vs_first": statistics.median(ratios),
            "vs_first_min_max": [ratios[0], ratios[-1]],
        })  # fmt: skip
        print(
            f"context {context:5d}: decode step {rows[-1]['decode_step_ms']:6.2f} ms (median of "
            f"{args.rounds}), x{rows[-1]['vs_first']:.2f} the step at {first} "
            f"(rounds {ratios[0]:.2f}-{ratios[-1]:.2f})"
        )
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
        "rounds": args.rounds,
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
