"""`kvserve engine-core`: one engine core on this host, for an API server on another host."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from kvserve.engine.args import MODEL_HELP, EngineArgs
from kvserve.options import HelpFormatter

DEFAULT_PORT = 29600

EPILOG = """\
example (an API server on host A, two engine cores on hosts B and C; the same secret on all three):
  host B:  KVSERVE_DIST_SECRET=... kvserve engine-core MODEL --host 10.0.0.2 --port 29600
  host C:  KVSERVE_DIST_SECRET=... kvserve engine-core MODEL --host 10.0.0.3 --port 29600
  host A:  KVSERVE_DIST_SECRET=... kvserve serve MODEL \\
             --remote-engine-core 10.0.0.2:29600 --remote-engine-core 10.0.0.3:29600
every host needs the model and the same engine options; the core exits when its API server leaves
(docs/parallel.md, "Engine cores on other hosts").
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "engine-core",
        help="run one engine core on this host for `kvserve serve --remote-engine-core` elsewhere",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument(
        "model", nargs="?", default=None, help=MODEL_HELP + " (default: smollm2-135m-instruct)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on for the API server: one of this host's (0.0.0.0: all)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port")
    parser.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)  # tests only
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (refused peers are warnings)",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.core.errors import InvalidRequestError
    from kvserve.engine.core_server import CoreServer
    from kvserve.engine.faults import FaultInjection
    from kvserve.engine.remote import SECRET_NEEDED_BY
    from kvserve.links import load_secret
    from kvserve.models import resolve_model

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s kvserve engine-core: %(message)s",
    )
    if not 0 <= args.port <= 65535:
        raise InvalidRequestError("--port must be in [0, 65535]", "port")
    config = EngineArgs.from_cli_args(
        args, model=str(resolve_model(args.model))
    ).create_engine_config()
    secret = load_secret(config.dist.secret_file, SECRET_NEEDED_BY)  # before anything starts
    server = CoreServer(
        config, args.host, args.port, secret, faults=FaultInjection.parse(args.inject_fault)
    )
    print(f"kvserve engine-core: listening on {server.address}", flush=True)
    # SIGTERM stops the core as Ctrl-C does (the relay's cleanup runs)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return server.run()
    except KeyboardInterrupt:
        return 0
