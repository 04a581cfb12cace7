"""`kvserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from kvserve.core.errors import InvalidRequestError
from kvserve.engine.args import MODEL_HELP, EngineArgs
from kvserve.options import HelpFormatter
from kvserve.server.limits import RequestLimits
from kvserve.server.tool_parsers import DEFAULT_MAX_PARALLEL_CALLS, TOOL_PARSERS

_EXIT_MARGIN_S = 2.0  # after the grace period: time for the cut streams' error events to go out

EPILOG = """\
examples:
  kvserve serve                                   # the built-in smollm2-135m-instruct on 127.0.0.1:8000
  kvserve serve kvserve-demo --speculative-model kvserve-demo-draft
  kvserve serve /path/to/hf-model --served-model-name my-model --port 8001
then open http://127.0.0.1:8000/ for the chat playground and the live dashboard.
"""


def register(subparsers) -> None:
    """Long: the `serve` flags beyond the generated engine options, one declaration each."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument(
        "model", nargs="?", default=None, help=MODEL_HELP + " (default: smollm2-135m-instruct)"
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
        metavar="ID:SECRET",
        help="require `Authorization: Bearer SECRET` on every route but /health, /ready, /metrics; "
        "usage is metered per key ID (repeatable; a bare SECRET gets the id keyN)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="reject with 429 + Retry-After when this many samples would wait for admission",
    )
    parser.add_argument(
        "--max-waiting-grammars",
        type=int,
        default=64,
        help="reject with 429 + Retry-After when this many requests wait for a new structured-output "
        "grammar to compile (one compiles at a time)",
    )
    limits = RequestLimits()
    parser.add_argument("--max-n", type=int, default=limits.max_n, help="largest n per request")
    parser.add_argument(
        "--max-samples",
        type=int,
        default=limits.max_samples,
        help="most samples (prompts x n) one request may create",
    )
    parser.add_argument(
        "--max-request-tokens",
        type=int,
        default=limits.max_request_tokens,
        help="most output tokens one request may ask for: samples x max_tokens (the context "
        "length for a request without max_tokens)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=limits.max_request_bytes,
        help="largest request body (413 above it)",
    )
    parser.add_argument(
        "--max-json-depth",
        type=int,
        default=limits.max_json_depth,
        help="deepest JSON nesting of a request body",
    )
    parser.add_argument(
        "--max-stop-strings",
        type=int,
        default=limits.max_stop_strings,
        help="stop strings per request",
    )
    parser.add_argument(
        "--max-stop-chars",
        type=int,
        default=limits.max_stop_chars,
        help="characters per stop string",
    )
    parser.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=limits.max_grammar_bytes,
        help="largest structured-output constraint (JSON schema, regex, grammar, choices as JSON); "
        "each compile is also bounded in time by --grammar-compile-timeout",
    )
    parser.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)  # tests only
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
        "--max-parallel-tool-calls",
        type=int,
        default=DEFAULT_MAX_PARALLEL_CALLS,
        metavar="N",
        help='most calls in one response to tool_choice "required" with parallel calls: the call '
        "grammar ends after N, so a model that never stops calling still ends (docs/tools.md)",
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
        help="on SIGTERM, seconds to let in-flight requests finish; then each gets an error",
    )
    parser.add_argument(
        "--ready-fd",
        type=int,
        default=None,
        metavar="FD",
        help="once the server listens and its model is loaded and warmed up, write one line `ready "
        "URL` to this inherited file descriptor (`failed: REASON` if the load failed) and close it: "
        "a supervisor or script waits on it instead of polling /ready",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level",
    )
    EngineArgs.add_cli_args(parser)
    add_core_arguments(parser)
    parser.set_defaults(func=run)


def add_core_arguments(parser) -> None:
    """Where the engine core runs (docs/engine_core.md)."""
    parser.add_argument(
        "--engine-core",
        choices=["process", "in-process"],
        default="process",
        help="run the engine core (scheduler, KV cache, model) in its own process, talking to the "
        "API server over ZMQ, or as a thread of the API server's process",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="start N engine-core processes behind one API server; a request goes to the core that "
        "holds its prompt's first block, else to the least loaded one (default: 1, or 0 with "
        "--remote-engine-core)",
    )
    parser.add_argument(
        "--remote-engine-core",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="also route to the engine core a `kvserve engine-core` serves at HOST:PORT on another "
        "host, over TCP after proving the shared secret ($KVSERVE_DIST_SECRET or "
        '--dist-secret-file); repeatable (docs/parallel.md, "Engine cores on other hosts")',
    )


def run(args: argparse.Namespace) -> int:
    """Long: the server's start-up in the order it happens (options, limits, engine client, app,
    signals, uvicorn), each step a few lines."""
    import logging

    import uvicorn

    from kvserve.engine.faults import FaultInjection
    from kvserve.models import builtin_name, resolve_model
    from kvserve.server.app import build_app
    from kvserve.server.metering import parse_api_keys
    from kvserve.server.serving import ServingOptions
    from kvserve.server.startup import startup_summary

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    notice = ReadyNotice(args.ready_fd, args.host)  # a bad descriptor fails before any work
    if args.model and args.model_option and args.model != args.model_option:
        raise InvalidRequestError(
            f"two models given: {args.model!r} and --model {args.model_option!r}", "model"
        )
    model_dir = resolve_model(args.model or args.model_option)
    engine_args = EngineArgs.from_cli_args(args, model=str(model_dir))
    options = engine_args.options()
    config = engine_args.create_engine_config()  # fail fast on bad options, before binding
    chat_template = _read_chat_template(args.chat_template) if args.chat_template else None
    _check_serving_numbers(args)
    try:  # a bad flag is a one-line error
        limits = RequestLimits(
            max_request_bytes=args.max_request_bytes,
            max_json_depth=args.max_json_depth,
            max_n=args.max_n,
            max_samples=args.max_samples,
            max_request_tokens=args.max_request_tokens,
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars,
            max_grammar_bytes=args.max_grammar_bytes,
        )
        api_keys = parse_api_keys(args.api_key)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "serve") from None
    serving = ServingOptions(
        served_model_name=args.served_model_name
        or builtin_name(model_dir)
        or model_dir.resolve().name,
        max_waiting=args.max_waiting,
        max_waiting_grammars=args.max_waiting_grammars,
        request_timeout_s=args.request_timeout,
        chat_template=chat_template,
        log_content=args.log_content,
        limits=limits,
        tool_call_parser=args.tool_call_parser,
        max_parallel_tool_calls=args.max_parallel_tool_calls,
    )
    url = f"http://{args.host}:{args.port}"
    faults = FaultInjection.parse(args.inject_fault)
    num_local = _check_cores(args)

    def load():
        print(f"kvserve: loading {serving.served_model_name!r} from {model_dir} ...", flush=True)
        if args.engine_core == "in-process":
            from kvserve.engine.async_engine import AsyncEngine
            from kvserve.engine.core import EngineCore

            client = AsyncEngine(EngineCore(config), faults=faults)
        else:
            from kvserve.engine.mp_client import MPClient

            client = MPClient(
                config, num_cores=num_local, faults=faults, remote_cores=args.remote_engine_core
            )
        print(
            startup_summary(client.info, serving.served_model_name, url, client.num_cores),
            flush=True,
        )
        return client

    holder: dict = {}

    def loaded(error: str | None) -> None:
        notice.loaded(error)
        if error is not None:  # never a server that is healthy with no model: exit, non-zero
            holder["server"].request_exit()

    app = build_app(
        load,
        serving,
        api_keys=api_keys,
        engine_options=options,
        on_fatal=lambda: holder["server"].request_exit(),
        on_loaded=loaded,
    )
    state = app.state.kvserve
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.grace_period + _EXIT_MARGIN_S,
        ),
        state,
        args.grace_period,
        notice,
    )
    holder["server"] = server
    server.run()
    if state.load_error is not None:
        print(f"kvserve serve: error: {' '.join(state.load_error.split())}", file=sys.stderr)
        return 1
    if state.dead_reason is not None:
        return 1  # a supervisor should restart us
    return 0


def _check_cores(args: argparse.Namespace) -> int:
    """The number of local engine cores; the layout's errors, before anything starts."""
    from kvserve.engine.remote import SECRET_NEEDED_BY, parse_address
    from kvserve.links import load_secret

    remote = args.remote_engine_core
    num_local = args.data_parallel_size
    if num_local is None:
        num_local = 0 if remote else 1
    if num_local < (0 if remote else 1):
        raise InvalidRequestError(
            "--data-parallel-size must be >= 1 (>= 0 with --remote-engine-core)",
            "data_parallel_size",
        )
    if (num_local > 1 or remote) and args.engine_core == "in-process":
        raise InvalidRequestError(
            "--data-parallel-size > 1 and --remote-engine-core need --engine-core process",
            "data_parallel_size",
        )
    for address in remote:
        parse_address(address)
    if remote:  # a missing secret is a start-up error, not a failed load after binding
        load_secret(args.dist_secret_file, SECRET_NEEDED_BY)
    return num_local


def _read_chat_template(path: str) -> str:
    """The template file's text, compiled once here: a broken template is a start-up error, not a 400
    on every chat request that blames the client's messages, and an empty file is not
    silently the tokenizer's own template."""
    import jinja2

    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise InvalidRequestError(f"--chat-template {path} is empty", "chat_template")
    try:  # transformers' own compiler: its extensions ({% break %}, {% generation %}) included
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_
    except ImportError:  # another transformers: jinja2 with the loop controls it enables
        compile_ = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse
    try:
        compile_(text)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(
            f"--chat-template {path}: line {exc.lineno}: {exc.message}", "chat_template"
        ) from None
    return text


def _check_serving_numbers(args: argparse.Namespace) -> None:
    """Ranges argparse's types do not express (--request-timeout 0 would answer every request 504,
    --max-waiting 0 every request 400; --port 70000 would fail inside uvicorn)."""
    checks = (
        (args.request_timeout is None or args.request_timeout > 0, "--request-timeout must be > 0"),
        (args.grace_period >= 0, "--grace-period must be >= 0"),
        (args.max_waiting is None or args.max_waiting >= 1, "--max-waiting must be >= 1"),
        (args.max_waiting_grammars >= 1, "--max-waiting-grammars must be >= 1"),
        (1 <= args.max_parallel_tool_calls <= 64, "--max-parallel-tool-calls must be in [1, 64]"),
        (0 <= args.port <= 65535, "--port must be in [0, 65535]"),
    )
    for ok, message in checks:
        if not ok:
            raise InvalidRequestError(message, "serve")


class _Server:
    """uvicorn's server, with kvserve's drain: SIGTERM / SIGINT start the grace period (uvicorn closes the
    listener and idle connections; a request on a connection still open gets a 503; open requests may
    finish, and at its end each is cut with an error), and the signal is not re-raised at exit, so a
    clean drain exits 0."""

    def __new__(cls, config, state, grace_period_s: float, notice: ReadyNotice):
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                await super().startup(sockets=sockets)
                if not self.should_exit:  # a failed bind exits instead
                    notice.listening(self.servers[0].sockets[0].getsockname()[1])

            def handle_exit(self, sig, frame) -> None:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True  # a second Ctrl-C: stop now
                    return
                self.request_exit()

            def request_exit(self) -> None:
                if state.loop is not None and not state.loop.is_closed():
                    state.loop.call_soon_threadsafe(state.begin_drain, grace_period_s)
                self.should_exit = True

        return Server(config)


class ReadyNotice:
    """`--ready-fd FD`, a readiness notification (as s6's): one line to the inherited descriptor FD once
    the server listens and its model load has ended: `ready URL` (the address it bound, with its
    port) when the model is loaded and warmed up, `failed: REASON` when the load failed (the process
    then exits 1 with the same reason on stderr, as it does when the engine dies). Then FD is closed. If the
    process exits first, the reader sees end of file. A waiting program blocks on one read instead of
    polling /ready."""

    def __init__(self, fd: int | None, host: str) -> None:
        from kvserve.core.errors import InvalidRequestError

        if fd is not None:
            if fd < 3:  # closing stdin / stdout / stderr would hand its number to the next socket
                raise InvalidRequestError(
                    f"--ready-fd {fd} is a standard stream; pass a descriptor of 3 or more",
                    "ready_fd",
                )
            try:
                os.fstat(fd)
            except OSError as exc:
                raise InvalidRequestError(
                    f"--ready-fd {fd} is not an open file descriptor ({exc.strerror})", "ready_fd"
                ) from None
            os.set_inheritable(fd, False)  # engine-core children must not hold it open
        self.fd, self.host = fd, host
        self.port: int | None = None
        self.load: tuple[str | None] | None = None  # (error or None,) once the load ended
        self.lock = threading.Lock()

    def listening(self, port: int) -> None:
        with self.lock:
            self.port = port
            self._send()

    def loaded(self, error: str | None) -> None:
        with self.lock:
            self.load = (error,)
            self._send()

    def _send(self) -> None:
        if self.fd is None or self.load is None or self.port is None:
            return  # both must have happened: a reader may probe /ready at once
        (error,) = self.load
        if error is not None:
            line = "failed: " + " ".join(error.split())[:1000]  # one line, short
        else:
            host = f"[{self.host}]" if ":" in self.host else self.host
            line = f"ready http://{host}:{self.port}"
        fd, self.fd = self.fd, None
        try:
            os.write(fd, (line + "\n").encode())
        except OSError:  # the reader went away: nobody to tell
            pass
        finally:
            os.close(fd)
