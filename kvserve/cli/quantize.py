"""`kvserve quantize MODEL_DIR --out DIR --weights FMT --method rtn`: write a quantised checkpoint
in the compressed-tensors layout, with its quantisation report and artifact hash
(docs/quantization.md)."""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.quant.methods import DEFAULT_METHOD


def register(subparsers) -> None:
    from kvserve.quant.methods import METHODS

    parser = subparsers.add_parser(
        "quantize",
        help="quantise a checkpoint's weights (compressed-tensors layout)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "model", help="float Hugging Face model directory or built-in name (kvserve-demo)"
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--weights", required=True, help="format: int8, int4-g128, int4-g128-zp, w8a8, ..."
    )
    parser.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        choices=sorted(METHODS),
        help="rounding method (docs/quantization.md)",
    )
    parser.add_argument(
        "--calib", default=None, help="calibration text (.jsonl with 'text', or plain text)"
    )
    parser.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens used")
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.alpha <= 1:  # outside, the scales become NaN and inf
        print(
            f"kvserve quantize: error: --alpha must be in [0, 1], got {args.alpha:g}",
            file=sys.stderr,
        )
        return 2
    from kvserve.core.errors import KVServeError
    from kvserve.models import resolve_model
    from kvserve.quant.pipeline import quantize_checkpoint

    try:
        report = quantize_checkpoint(
            resolve_model(args.model),
            args.out,
            weights=args.weights,
            method=args.method,
            calib=args.calib,
            calib_tokens=args.calib_tokens,
            alpha=args.alpha,
        )
    except KVServeError as exc:
        print(f"kvserve quantize: error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in report.items() if k != "tensors"}
    print(json.dumps(summary, indent=2))
    return 0
