"""`kvserve generate`: run the offline engine on a prompt from the command line."""

from __future__ import annotations

import argparse
import json
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` shows every flag's default (unless it is None or a switch's False) and keeps the
    epilogs' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


MODEL_HELP = "model directory, or a built-in name: kvserve-demo, kvserve-demo-draft"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by `generate`, `serve` and the benchmarks."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto: fp32 on CPU, the checkpoint's bf16/fp16 on CUDA",
    )
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens, prompt + output (default: the model's limit)",
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=64, help="most sequences running at once"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step, shared by decode tokens and prompt chunks",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    group.add_argument(
        "--kv-cache-memory",
        default="512MiB",
        help="memory for the KV cache, e.g. 512MiB, 2GiB, or bytes",
    )
    group.add_argument(
        "--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes"
    )
    group.add_argument(
        "--admission",
        default="on_demand",
        choices=["on_demand", "reserve"],
        help="on_demand: charge blocks as used, preempt when full; reserve: prompt + max_tokens "
        "up front (docs/scheduling.md)",
    )
    group.add_argument("--seed", type=int, default=0, help="engine random seed")
    group.add_argument(
        "--quantization",
        default=None,
        help="quantise weights at load (round to nearest): int8, int4-g128, w8a8, "
        "linear=int4-g64,head=int8, ... (docs/quantization.md)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8"],
        help="KV cache storage: the model's dtype, or 8-bit codes + fp16 scales per token and head",
    )
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu", "torch"],
        help="auto: the in-place C kernels on CPU with fp32 weights; torch: torch ops only",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N ranks (worker processes; gloo on CPU, NCCL on CUDA; "
        "docs/parallel.md)",
    )
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-model",
        default=None,
        help="draft model directory or built-in name (kvserve-demo-draft); same tokenizer",
    )
    spec.add_argument(
        "--speculative-method",
        default=None,
        choices=["draft", "ngram"],
        help="draft model or n-gram lookup (default: draft when --speculative-model is given)",
    )
    spec.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="gamma: proposals per step"
    )
    spec.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram to match")
    spec.add_argument("--ngram-max", type=int, default=4, help="longest n-gram to match")


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
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text offline with the engine",
        formatter_class=HelpFormatter,
        epilog="example:\n  kvserve generate --prompt 'def fibonacci(n):' --max-tokens 32",
    )
    parser.add_argument("--model", default="kvserve-demo", help=MODEL_HELP)
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (0: all)")
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument(
        "--stop", action="append", default=[], help="stop string, never emitted (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
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
        print(f"kvserve generate: error: {exc}", file=sys.stderr)
        return 2
    for index, output in enumerate(outputs):
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
        elif len(outputs) == 1:
            print(completion.text)
        else:  # several prompts: label each answer so they do not run together
            print(f"--- [{index}] prompt: {output.prompt!r} (finish: {completion.finish_reason})")
            print(completion.text)
    return 0
