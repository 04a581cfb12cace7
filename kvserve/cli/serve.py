"""`kvserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.cli.generate import add_engine_arguments, engine_options
from kvserve.server.tool_parsers import TOOL_PARSERS


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Hugging Face model directory (default: the embedded demo model)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="name clients use (default: the directory's name; kvserve-demo for the embedded model)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require `Authorization: Bearer KEY` on the API (repeatable)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="reject with 429 + Retry-After when this many requests wait for admission",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="abort a request after this many seconds",
    )
    parser.add_argument("--chat-template", default=None, help="Jinja chat template file to use")
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="find tool calls in the output of tool_choice auto requests (docs/tools.md)",
    )
    parser.add_argument(
        "--log-content",
        action="store_true",
        help="log prompt and output text (off: sizes and timings)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    parser.add_argument("--log-level", default="info")
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvserve.engine.args import build_engine_config
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models import default_model_dir
    from kvserve.server.app import build_app
    from kvserve.server.serving import ServingOptions

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model_dir = Path(args.model) if args.model else default_model_dir()
    options = engine_options(args)
    config = build_engine_config(model_dir, **options)  # fail fast on bad options, before binding
    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    serving = ServingOptions(
        served_model_name=args.served_model_name
        or ("kvserve-demo" if args.model is None else model_dir.resolve().name),
        max_waiting=args.max_waiting,
        request_timeout_s=args.request_timeout,
        chat_template=chat_template,
        log_content=args.log_content,
        tool_call_parser=args.tool_call_parser,
    )
    app = build_app(
        lambda: LLMEngine(config), serving, api_keys=tuple(args.api_key), engine_options=options
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.grace_period,
    )
    return 0
