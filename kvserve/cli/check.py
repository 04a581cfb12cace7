"""`kvserve check batch-invariance MODEL`: is a prompt's greedy output the same alone and in
batches (sizes, neighbours' lengths, chunked prefill, prefix-cache hit, speculative verification)?
A JSON report and a one-screen summary (definitions: docs/determinism.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.config import GGUF_ACTIVATIONS

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "import numpy as np\nimport torch\n\nclass",
    "Q: What is 17 times 23?\nA:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1905, Albert Einstein published four papers that changed physics. The first explained",
    "for i in range(10):\n    print(",
)

EPILOG = """\
examples:
  kvserve check batch-invariance kvserve-demo
  kvserve check batch-invariance ./my-model --prompts prompts.txt --output report.json
  kvserve check batch-invariance --endpoint http://127.0.0.1:8000 --max-tokens 16

--prompts FILE: one prompt per line, or JSON lines with "prompt" (text) or "prompt_token_ids".
"""


def register(subparsers: Any) -> None:
    from kvserve.lab.check.shapes import CheckConfig

    p = subparsers.add_parser("check", help="self-checks: batch invariance of greedy outputs")
    sub = p.add_subparsers(dest="check", metavar="CHECK")
    b = sub.add_parser(
        "batch-invariance",
        help="each prompt alone vs in batch shapes: tokens, log-prob differences, top-two gaps",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("model", nargs="?", help="model directory or kvserve-demo (offline)")
    b.add_argument("--endpoint", metavar="URL", help="check a running server instead")
    b.add_argument("--served-model", default=None, help="model name on the server (its first)")
    b.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for each answer (--endpoint)"
    )
    b.add_argument("--prompts", metavar="FILE", help="prompts (default: 8 built-in texts)")
    # defaults: the check's own configuration's
    b.add_argument(
        "--max-tokens", type=int, default=CheckConfig.max_tokens, help="greedy tokens per prompt"
    )
    b.add_argument(
        "--logprobs", type=int, default=CheckConfig.num_logprobs, help="top-k log probabilities"
    )
    b.add_argument(
        "--batch-sizes",
        default=",".join(str(n) for n in CheckConfig.batch_sizes),
        help="batch sizes, comma-separated",
    )
    b.add_argument(
        "--chunk-tokens", type=int, default=CheckConfig.chunk_tokens, help="chunked-prefill budget"
    )
    b.add_argument("--dtype", default="float32", help="engine dtype (float32)")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    b.add_argument(
        "--quantization",
        metavar="FMT",
        default=None,
        help="the engine's --quantization (offline; docs/quantization.md)",
    )
    b.add_argument(
        "--gguf-activations",
        default="auto",
        choices=GGUF_ACTIVATIONS,
        help="a GGUF model's products, as the engine's --gguf-activations (offline; docs/gguf.md)",
    )
    b.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    b.add_argument("--seed", type=int, default=CheckConfig.seed, help="seed of the prompts")
    b.add_argument("--output", metavar="FILE", help="write the JSON report here")
    b.add_argument("--json", action="store_true", help="print the JSON report, not the summary")
    b.set_defaults(func=run)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def read_prompts(path: str | None) -> list[str | list[int]]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --prompts {path}: {exc.strerror}") from exc
    prompts: list[str | list[int]] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from exc
            ids = obj.get("prompt_token_ids")
            if "prompt_token_ids" in obj:
                if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):  # 5, null, [1.7, true] are refused, not coerced
                    raise ValueError(f'{path}:{n}: "prompt_token_ids" must be a list of integers')
                prompts.append(list(ids))
            elif isinstance(obj.get("prompt"), str):
                prompts.append(obj["prompt"])
            else:
                raise ValueError(f'{path}:{n}: needs "prompt" (text) or "prompt_token_ids"')
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def resolve_model(name: str) -> str:
    """A built-in name (`demo`: kvserve-demo) or a GGUF file -> its model directory."""
    from kvserve.gguf.model_dir import is_gguf_path
    from kvserve.models import BUILTIN_MODELS, DEMO_MODEL
    from kvserve.models import resolve_model as resolve

    name = DEMO_MODEL if name == "demo" else name
    return str(resolve(name)) if name in BUILTIN_MODELS or is_gguf_path(name) else name


def run(args: argparse.Namespace) -> int:
    from kvserve.core.errors import KVServeError
    from kvserve.lab.check.report import build_report, render_summary
    from kvserve.lab.check.shapes import CheckConfig

    log = sys.stderr if args.json else sys.stdout
    try:
        sizes = tuple(int(s) for s in args.batch_sizes.split(",") if s.strip())
        cfg = CheckConfig(
            max_tokens=args.max_tokens,
            num_logprobs=args.logprobs,
            batch_sizes=sizes,
            chunk_tokens=args.chunk_tokens,
            seed=args.seed,
        )
        prompts = read_prompts(args.prompts)
        if args.endpoint:
            from kvserve.lab.check.endpoint import EndpointCheck

            offline_only = {
                "--quantization": args.quantization,
                "--gguf-activations": args.gguf_activations != "auto",
            }
            for flag, given in offline_only.items():
                if given:
                    raise ValueError(
                        f"{flag} is for the offline check; with --endpoint the server's own "
                        "format runs (its /manifest)"
                    )
            if not args.timeout > 0:
                raise ValueError(f"--timeout must be > 0, got {args.timeout:g}")
            check = EndpointCheck(
                args.endpoint, args.served_model, prompts, cfg, timeout_s=args.timeout
            )
            target = {"kind": "endpoint", "endpoint": args.endpoint, "model": check.model}
        else:
            if not args.model:
                raise ValueError("give a MODEL directory (or kvserve-demo), or --endpoint URL")
            check, target = _offline(args, cfg, prompts)
        check.progress = lambda name: print(f"  {name}", file=sys.stderr, flush=True)
        refs, results = check.run()
    except (KVServeError, ValueError, RuntimeError, OSError) as exc:
        print(f"kvserve check: {exc}", file=sys.stderr)
        return 2
    config = {
        "max_tokens": cfg.max_tokens,
        "logprobs": cfg.num_logprobs,
        "batch_sizes": list(cfg.batch_sizes),
        "chunk_tokens": cfg.chunk_tokens,
        "prompts": args.prompts or "built-in",
    }
    report = build_report(target, config, refs, results)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print(render_summary(report), end="", file=log)
    return 0


def _offline(args: argparse.Namespace, cfg, prompts):
    from kvserve import LLM
    from kvserve.lab.check.shapes import OfflineCheck

    model = resolve_model(args.model)
    options = {"dtype": args.dtype, "device": args.device, "seed": args.seed}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.quantization:
        options["quantization"] = args.quantization
    if args.gguf_activations != "auto":
        options["gguf_activations"] = args.gguf_activations

    def make_llm(**extra):
        return LLM(model, **(options | extra))

    target = {
        "kind": "offline",
        "model": args.model,
        "model_dir": model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "gguf_activations": args.gguf_activations,
    }
    return OfflineCheck(make_llm, prompts, cfg), target
