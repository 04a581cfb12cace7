"""A node other than node 0 (`kvserve tp-node`, docs/parallel.md "Across hosts"): it runs only
tensor-parallel ranks, no engine and no API server.

It connects to node 0's `--dist-init-addr`, proves the shared secret (kvserve.links),
sends its options' fingerprint, and learns the store address and the KV block count. It then starts
its ranks as worker processes (`kvserve.runner.worker.worker_main`, the same loop as a local rank's)
and relays: node 0's forward commands to every rank's pipe, each rank's READY and error reports back.
It ends, stopping its ranks, when node 0 says stop, when node 0's connection closes, or when one of
its ranks fails (after reporting which and why).
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from kvserve.config import EngineConfig
from kvserve.links import (
    Channel,
    client_handshake,
    connect,
    gloo_environment,
    load_secret,
)
from kvserve.mp_children import children_allowed
from kvserve.runner.executor import _rank_device, stop_ranks, threads_per_rank
from kvserve.runner.nodes import fingerprint
from kvserve.runner.worker import ERROR, FORWARD, READY, STOP, RankSpec, worker_main
from kvserve.threads import spawn_environment

logger = logging.getLogger(__name__)


class NodeError(RuntimeError):
    """This node cannot join or go on; the message is one line for the operator."""


def join(config: EngineConfig) -> tuple[Channel, str, int, int]:
    """Connect and authenticate to node 0 within --dist-timeout: (channel, store host, store port,
    KV blocks)."""
    dist = config.dist
    host, port = dist.address
    secret = load_secret(dist.secret_file)
    deadline = time.monotonic() + dist.timeout_s
    try:
        sock = connect(host, port, deadline)
        channel = client_handshake(sock, secret)
        channel.send(["hello", dist.node_rank, fingerprint(config)])
        reply = channel.recv(timeout_s=max(1.0, deadline - time.monotonic()))
    except (OSError, ValueError) as exc:  # timeouts, refusals, authentication failures
        raise NodeError(f"could not join node 0 at {host}:{port}: {exc}") from None
    if reply[0] == ERROR:
        raise NodeError(str(reply[1]))
    _, store_host, store_port, num_blocks = reply
    return channel, store_host, store_port, num_blocks


def run_node(config: EngineConfig) -> None:
    """Join node 0 and run this node's ranks until node 0 stops them; raises NodeError on failure."""
    dist = config.dist
    world = config.tensor_parallel_size
    ranks = dist.node_ranks(world)
    channel, store_host, store_port, num_blocks = join(config)
    local_address = channel.sock.getsockname()[0]
    os.environ.update(gloo_environment(local_address))
    cuda = torch.device(config.device).type == "cuda"
    threads = 1 if cuda else threads_per_rank(len(ranks))
    context = mp.get_context("spawn")
    workers, conns = [], []
    where = f"node {dist.node_rank} ({local_address})"
    try:
        for index, rank in enumerate(ranks):
            spec = RankSpec(
                rank,
                world,
                f"tcp://{store_host}:{store_port}",
                "nccl" if cuda else "gloo",
                _rank_device(config.device, index),
                threads,
                dist.timeout_s,
            )
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(spec, config, num_blocks, child),
                name=f"kvserve-tp-rank{rank}",
                daemon=True,
            )
            with children_allowed(), spawn_environment():
                process.start()
            child.close()
            workers.append(process)
            conns.append(parent)
        logger.info("%s: ranks %d-%d started", where, ranks.start, ranks.stop - 1)
        _relay(channel, workers, conns, ranks, where)
    finally:
        stop_ranks(workers, conns)
        channel.close()


def _relay(channel: Channel, workers: list, conns: list, ranks: range, where: str) -> None:
    sentinels = {p.sentinel: rank for p, rank in zip(workers, ranks, strict=True)}
    pipes = {id(conn): rank for conn, rank in zip(conns, ranks, strict=True)}
    while True:
        for ready in wait([channel, *conns, *sentinels]):
            if ready is channel:
                try:
                    command = channel.recv(timeout_s=30.0)
                except (OSError, ValueError) as exc:
                    raise NodeError(f"{where}: lost node 0 ({exc}); stopping") from None
                if command[0] == STOP:
                    return
                _, ops, chunks, rows = command  # block-table operations first, then the chunks
                for conn in conns:
                    conn.send((FORWARD, ops, chunks, rows))
            elif isinstance(ready, int):  # a rank's process ended
                rank = sentinels[ready]
                code = workers[rank - ranks.start].exitcode
                _report(channel, f"rank {rank} on {where} exited with code {code}")
            else:
                rank = pipes[id(ready)]
                try:
                    message = ready.recv()
                except (EOFError, OSError):
                    code = workers[rank - ranks.start].exitcode
                    _report(channel, f"rank {rank} on {where} exited with code {code}")
                if message[0] == READY:
                    channel.send([READY, rank, message[1], message[2]])
                    logger.info("%s: rank %d loaded", where, rank)
                else:
                    first = str(message[1]).strip().splitlines()
                    _report(channel, f"{where}: {first[-1] if first else message[1]}")


def _report(channel: Channel, text: str) -> None:
    """Tell node 0 why this node stops (if it still listens), then stop."""
    try:
        channel.send([ERROR, text])
    except OSError:
        pass
    raise NodeError(text)
