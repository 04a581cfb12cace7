"""`kvserve serve`'s own options: each declared once here, in `ServingOptions` (how requests are
served) or in `RequestLimits` (what one request may ask for), with its name, type, default, help
and bound (kvserve/core/options.py). The flags, their checks and the table in docs/options.md are
generated from these declarations (kvserve/cli/options_doc.py); the engine's options are
`EngineArgs`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvserve.core.options import add_flags, check_options, flag_of, option, values_from_cli
from kvserve.server.limits import RequestLimits
from kvserve.server.serving import ServingOptions

LOG_LEVELS = ("debug", "info", "warning", "error")
ENGINE_CORE_MODES = ("process", "in-process")


@dataclass(frozen=True)
class ServeArgs:
    """The server process's flags: where it listens, who may call it, how it starts and stops, and
    where its engine cores run (docs/server.md, docs/engine_core.md)."""

    host: str = option("127.0.0.1", "address to bind (0.0.0.0: all)")
    port: int = option(8000, "TCP port", ge=0, le=65535)
    served_model_name: str | None = option(
        None, "name clients use (default: the built-in name, else the directory's name)"
    )
    api_key: tuple[str, ...] = option(
        (),
        "require `Authorization: Bearer SECRET` on every route but /health, /ready, /metrics; "
        "usage is metered per key ID (repeatable; a bare SECRET gets the id keyN)",
        metavar="ID:SECRET",
    )
    chat_template: str | None = option(None, "Jinja chat template file to use", metavar="FILE")
    grace_period: float = option(
        30.0,
        "on SIGTERM, seconds to let in-flight requests finish; then each gets an error",
        ge=0,
    )
    ready_fd: int | None = option(
        None,
        "once the server listens and its model is loaded and warmed up, write one line `ready "
        "URL` to this inherited file descriptor (`failed: REASON` if the load failed) and close "
        "it: a supervisor or script waits on it instead of polling /ready",
        metavar="FD",
    )
    log_level: str = option("info", "server log level", choices=LOG_LEVELS)
    inject_fault: str | None = option(None, "tests only (kvserve/engine/faults.py)", hidden=True)
    engine_core: str = option(
        "process",
        "run the engine core (scheduler, KV cache, model) in its own process, talking to the "
        "API server over ZMQ, or as a thread of the API server's process",
        choices=ENGINE_CORE_MODES,
        group="engine core",
    )
    data_parallel_size: int | None = option(
        None,
        "start N engine-core processes behind one API server; a request goes to the core that "
        "holds its prompt's first block, else to the least loaded one (default: 1, or 0 with "
        "--remote-engine-core)",
        metavar="N",
        group="engine core",
    )
    remote_engine_core: tuple[str, ...] = option(
        (),
        "also route to the engine core a `kvserve engine-core` serves at HOST:PORT on another "
        "host, over TCP after proving the shared secret ($KVSERVE_DIST_SECRET or "
        '--dist-secret-file); repeatable (docs/parallel.md, "Engine cores on other hosts")',
        metavar="HOST:PORT",
        group="engine core",
    )

    def __post_init__(self) -> None:
        check_options(self, flag_of)


# the option classes whose flags `kvserve serve` adds beside the engine's, in --help's order
SERVE_OPTION_CLASSES = (ServeArgs, ServingOptions, RequestLimits)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of `SERVE_OPTION_CLASSES` on `parser`."""
    groups: dict = {}
    for cls in SERVE_OPTION_CLASSES:
        add_flags(parser, cls, groups)


def serve_options_from_cli(
    args: argparse.Namespace,
) -> tuple[ServeArgs, dict, RequestLimits]:
    """The parsed flags as `ServeArgs`, `ServingOptions`' keyword arguments (without the model's
    name and the template's text, which `kvserve serve` resolves) and `RequestLimits`; a value out
    of its bound is an `InvalidRequestError` naming the flag ('--max-n must be >= 1, got 0')."""
    serve = ServeArgs(**values_from_cli(ServeArgs, args))
    serving = values_from_cli(ServingOptions, args)
    limits = RequestLimits(**values_from_cli(RequestLimits, args))
    return serve, serving, limits
