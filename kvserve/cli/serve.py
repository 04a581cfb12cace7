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
from kvserve.server.args import add_serve_flags, serve_options_from_cli

_EXIT_MARGIN_S = 2.0  # after the grace period: time for the cut streams' error events to go out

EPILOG = """\
examples:
  kvserve serve                                   # the built-in smollm2-135m-instruct on 127.0.0.1:8000
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
        "model", nargs="?", default=None, help=MODEL_HELP + " (default: smollm2-135m-instruct)"
    )
    parser.add_argument(
        "--model",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the same as the positional MODEL (vLLM's spelling)",
    )
    add_serve_flags(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


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

    serve, serving_values, limits = serve_options_from_cli(args)
    logging.basicConfig(
        level=serve.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    notice = ReadyNotice(serve.ready_fd, serve.host)  # a bad descriptor fails before any work
    if args.model and args.model_option and args.model != args.model_option:
        raise InvalidRequestError(
            f"two models given: {args.model!r} and --model {args.model_option!r}", "model"
        )
    model_dir = resolve_model(args.model or args.model_option)
    engine_args = EngineArgs.from_cli_args(args, model=str(model_dir))
    options = engine_args.options()
    config = engine_args.create_engine_config()  # fail fast on bad options, before binding
    chat_template = _read_chat_template(serve.chat_template) if serve.chat_template else None
    try:  # a bad key is a one-line error
        api_keys = parse_api_keys(serve.api_key)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "api_key") from None
    serving = ServingOptions(
        served_model_name=serve.served_model_name
        or builtin_name(model_dir)
        or model_dir.resolve().name,
        chat_template=chat_template,
        limits=limits,
        **serving_values,
    )
    url = f"http://{serve.host}:{serve.port}"
    faults = FaultInjection.parse(serve.inject_fault)
    num_local = _check_cores(args)

    def load():
        print(f"kvserve: loading {serving.served_model_name!r} from {model_dir} ...", flush=True)
        if serve.engine_core == "in-process":
            from kvserve.engine.async_engine import AsyncEngine
            from kvserve.engine.core import EngineCore

            client = AsyncEngine(EngineCore(config), faults=faults)
        else:
            from kvserve.engine.mp_client import MPClient

            client = MPClient(
                config,
                num_cores=num_local,
                faults=faults,
                remote_cores=list(serve.remote_engine_core),
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
            host=serve.host,
            port=serve.port,
            log_level=serve.log_level,
            timeout_graceful_shutdown=serve.grace_period + _EXIT_MARGIN_S,
        ),
        state,
        serve.grace_period,
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
