"""`kvserve generate`: run the offline engine on a prompt from the command line."""

from __future__ import annotations

import argparse
import json


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by `generate`, `serve` and the benchmarks."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    group.add_argument("--device", default="cpu")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument(
        "--kv-cache-memory",
        default="512MiB",
        help="memory for the KV cache, e.g. 512MiB, 2GiB, or bytes (default 512MiB)",
    )
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
        help="KV cache storage: the model's dtype, or 8-bit codes + fp16 scales per token and head",
    )  # fmt: skip
    group.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    group.add_argument("--admission", default="on_demand", choices=["on_demand", "reserve"])
    group.add_argument("--seed", type=int, default=0)
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-model", default=None, help="draft model directory (same tokenizer)"
    )
    spec.add_argument("--speculative-method", default=None, choices=["draft", "ngram"])
    spec.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="gamma: proposals per step"
    )
    spec.add_argument("--ngram-min", type=int, default=1)
    spec.add_argument("--ngram-max", type=int, default=4)


def parse_bytes(text: str) -> int:
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
        enable_prefix_caching=not args.no_prefix_caching,
        admission=args.admission,
        seed=args.seed,
        speculative_model=args.speculative_model,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text offline with the engine")
    parser.add_argument(
        "--model", default=None, help="model directory (default: the embedded demo model)"
    )
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON with token ids and timings")
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.core.errors import KVServeError
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM

    try:
        llm = LLM(args.model, **engine_options(args))
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sample_seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        outputs = llm.generate(args.prompt, params)
    except KVServeError as exc:
        print(f"error: {exc}")
        return 2
    for output in outputs:
        completion = output.outputs[0]
        if args.json:
            metrics = completion.metrics
            print(
                json.dumps(
                    {
                        "prompt": output.prompt,
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                        "num_prompt_tokens": len(output.prompt_token_ids),
                        "ttft_s": metrics.ttft_s,
                        "e2e_s": metrics.finished_time - metrics.arrival_time,
                    }
                )
            )
        else:
            print(completion.text)
    return 0
