"""`kvserve generate`: run the offline engine on a prompt from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.core.options import add_flags, values_from_cli
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import MODEL_HELP, EngineArgs
from kvserve.options import HelpFormatter

# generate's own defaults where they differ from SamplingParams' (16 tokens, temperature 1.0): a run
# from the command line is a look at what the model says, so longer and reproducible (greedy).
SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}
# the sampling flags' attributes of `args` (SamplingParams.seed beside the engine's `seed`)
_SAMPLING_DEST = "sampling_"


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
    parser.add_argument("--json", action="store_true", help="print JSON with token ids and timings")
    add_flags(
        parser,
        SamplingParams,
        {None: parser.add_argument_group("sampling")},
        defaults=SAMPLING_DEFAULTS,
        dest_prefix=_SAMPLING_DEST,
    )
    parser.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)  # tests only
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.core.errors import KVServeError
    from kvserve.engine.faults import FaultInjection
    from kvserve.engine.llm import LLM
    from kvserve.runner.executor import WorkerFailedError

    try:
        faults = FaultInjection.parse(args.inject_fault)
    except ValueError as exc:
        print(f"kvserve generate: error: --inject-fault: {exc}", file=sys.stderr)
        return 2
    try:
        # checked before the model loads: a bad flag costs nothing
        params = SamplingParams(**values_from_cli(SamplingParams, args, _SAMPLING_DEST))
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, model=args.model))
        llm.engine.gate_steps(faults)
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
