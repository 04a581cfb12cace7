"""`kvserve generate`: run the offline engine on a prompt from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.engine.args import MODEL_HELP, EngineArgs
from kvserve.options import HelpFormatter


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text offline with the engine",
        formatter_class=HelpFormatter,
        epilog="example:\n  kvserve generate --prompt 'def fibonacci(n):' --max-tokens 32",
    )
    parser.add_argument(
        "--model", default=None, help=MODEL_HELP + " (default: smollm2-135m-instruct)"
    )
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
    parser.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)  # tests only
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.core.errors import KVServeError
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.faults import FaultInjection
    from kvserve.engine.llm import LLM
    from kvserve.runner.executor import WorkerFailedError

    try:
        faults = FaultInjection.parse(args.inject_fault)
    except ValueError as exc:
        print(f"kvserve generate: error: --inject-fault: {exc}", file=sys.stderr)
        return 2
    try:
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, model=args.model))
        llm.engine.gate_steps(faults)
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
    except (KVServeError, ConnectionError) as exc:  # ConnectionError: no test at the gate's address
        print(f"kvserve generate: error: {exc}", file=sys.stderr)
        return 2
    except WorkerFailedError as exc:  # a tensor-parallel rank (here or on another host) failed
        print(f"kvserve generate: error: {exc}", file=sys.stderr)
        return 1
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
