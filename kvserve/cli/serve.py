"""`kvserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.cli.generate import MODEL_HELP, HelpFormatter, add_engine_arguments, engine_options

EPILOG = """\
examples:
  kvserve serve                                   # the built-in kvserve-demo on 127.0.0.1:8000
  kvserve serve kvserve-demo --speculative-model kvserve-demo-draft
  kvserve serve /path/to/hf-model --served-model-name my-model --port 8001
then open http://127.0.0.1:8000/ for the chat playground and the live dashboard.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument(
        "model", nargs="?", default=None, help=MODEL_HELP + " (default: kvserve-demo)"
    )
    parser.add_argument(
        "--model",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the same as the positional MODEL (vLLM's spelling)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="name clients use (default: the built-in name, else the directory's name)",
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
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level",
    )
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvserve.core.errors import InvalidRequestError
    from kvserve.engine.args import build_engine_config
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models import builtin_name, resolve_model
    from kvserve.server.app import build_app
    from kvserve.server.serving import ServingOptions
    from kvserve.server.startup import startup_summary

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.model and args.model_option and args.model != args.model_option:
        raise InvalidRequestError(
            f"two models given: {args.model!r} and --model {args.model_option!r}", "model"
        )
    model_dir = resolve_model(args.model or args.model_option)
    options = engine_options(args)
    config = build_engine_config(model_dir, **options)  # fail fast on bad options, before binding
    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    serving = ServingOptions(
        served_model_name=args.served_model_name
        or builtin_name(model_dir)
        or model_dir.resolve().name,
        max_waiting=args.max_waiting,
        request_timeout_s=args.request_timeout,
        chat_template=chat_template,
        log_content=args.log_content,
    )
    url = f"http://{args.host}:{args.port}"

    def load() -> LLMEngine:
        print(f"kvserve: loading {serving.served_model_name!r} from {model_dir} ...", flush=True)
        engine = LLMEngine(config)
        print(startup_summary(engine, serving.served_model_name, url), flush=True)
        return engine

    app = build_app(load, serving, api_keys=tuple(args.api_key), engine_options=options)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.grace_period,
    )
    return 0
