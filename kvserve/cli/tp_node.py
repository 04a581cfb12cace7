"""`kvserve tp-node`: run this host's tensor-parallel ranks for an engine on node 0."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.engine.args import MODEL_HELP, EngineArgs
from kvserve.options import HelpFormatter

EPILOG = """\
example (two hosts, TP=2, one rank each; the same secret on both):
  host A:  KVSERVE_DIST_SECRET=... kvserve serve MODEL --tensor-parallel-size 2 \\
             --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:29500
  host B:  KVSERVE_DIST_SECRET=... kvserve tp-node MODEL --tensor-parallel-size 2 \\
             --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:29500
every node needs the model and the same engine options (docs/parallel.md, "Across hosts").
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tp-node",
        help="run this host's tensor-parallel ranks for an engine on another host (node 0)",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument(
        "model", nargs="?", default=None, help=MODEL_HELP + " (default: smollm2-135m-instruct)"
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.core.errors import InvalidRequestError
    from kvserve.runner.node_agent import NodeError, run_node

    logging.basicConfig(level=logging.INFO, format="kvserve tp-node: %(message)s")
    config = EngineArgs.from_cli_args(args, model=args.model).create_engine_config()
    if not config.dist.multi_node or config.dist.node_rank == 0:
        raise InvalidRequestError(
            "kvserve tp-node runs a node other than node 0: pass --nnodes K (> 1), "
            "--node-rank R (1..K-1) and node 0's --dist-init-addr HOST:PORT",
            "node_rank",
        )
    try:
        run_node(config)
    except NodeError as exc:
        print(f"kvserve tp-node: error: {exc}", file=sys.stderr)
        return 1
    return 0
