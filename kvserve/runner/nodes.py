"""Node 0's side of multi-host tensor parallelism (docs/parallel.md, "Across hosts").

`NodeGroup` listens on `--dist-init-addr`, admits each other node once it has proved the shared
secret (kvserve.links) and sent the same engine options, and then tells it where the
torch.distributed store is and how many KV blocks to allocate. Afterwards each node is a
`RemoteNode`: rank 0 sends it every forward's input, and it reports its ranks' READY, their errors,
and its own end (the connection closing).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.links import Channel, listen, server_handshake

logger = logging.getLogger(__name__)


class NodeJoinError(RuntimeError):
    """A node did not join in time, or joined with other options than node 0's."""


def fingerprint(config: EngineConfig) -> dict:
    """What every node must agree on to compute the same forward as node 0."""
    return {
        "tensor_parallel_size": config.tensor_parallel_size,
        "nnodes": config.dist.nnodes,
        "model": hashlib.sha256(repr(config.model).encode()).hexdigest()[:16],
        "dtype": config.dtype,
        "quantization": config.quantization,
        "attention_backend": config.attention_backend,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "block_size": config.cache.block_size,
        "max_model_len": config.scheduler.max_model_len,
    }


def describe_mismatch(mine: dict, theirs: dict) -> str:
    diffs = [
        f"{key} {theirs.get(key)!r} (node 0: {value!r})"
        for key, value in mine.items()
        if theirs.get(key) != value
    ]
    return ", ".join(diffs)


@dataclass
class RemoteNode:
    """A joined node: its channel and the global ranks it runs."""

    node_rank: int
    ranks: range
    channel: Channel
    address: str
    reports: list[str] = field(default_factory=list)
    closed: bool = False

    def name(self) -> str:
        return f"node {self.node_rank} ({self.address}, ranks {self.ranks.start}-{self.ranks.stop - 1})"

    def drain(self, timeout_s: float = 0.0) -> None:
        """Read whatever the node sent unasked (error reports, its end) within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            left = max(0.0, deadline - time.monotonic())
            if not self.channel.readable(left):
                return
            try:
                message = self.channel.recv(timeout_s=max(left, 1.0))
            except (ConnectionError, TimeoutError, ValueError) as exc:
                self.closed = True
                if not self.reports:
                    self.reports.append(f"{self.name()} lost: {exc}")
                return
            if message[0] == "error":
                self.reports.append(str(message[1]))

    def failure(self) -> str | None:
        """Why this node can no longer run a step, or None (checked before each forward)."""
        self.drain(0.0)
        if self.reports:
            return self.reports[0]
        if self.closed:
            return f"{self.name()} closed its connection"
        return None

    def send(self, message) -> None:
        self.channel.send(message)

    def stop(self) -> None:
        if not self.closed:
            try:
                self.channel.send(["stop"])
            except OSError:
                pass
        self.channel.close()
        self.closed = True


class NodeGroup:
    """Node 0's listener and the nodes that joined it."""

    def __init__(self, config: EngineConfig, secret: bytes) -> None:
        self.config = config
        self.host, self.port = config.dist.address
        self._secret = secret
        self._listener = listen(self.host, self.port)
        self.nodes: dict[int, RemoteNode] = {}

    def admit(self, store_port: int, num_blocks: int, deadline: float) -> list[RemoteNode]:
        """Wait until every other node has joined (or raise NodeJoinError at `deadline`). A peer
        that fails the handshake is logged and dropped; the wait goes on."""
        dist = self.config.dist
        mine = fingerprint(self.config)
        while len(self.nodes) < dist.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, dist.nnodes)) - set(self.nodes))
                raise NodeJoinError(
                    f"node(s) {', '.join(map(str, missing))} of {dist.nnodes} did not join "
                    f"{self.host}:{self.port} within {dist.timeout_s:g} s (--dist-timeout): start "
                    "`kvserve tp-node` there with the same --dist-init-addr and secret"
                )
            self._listener.settimeout(min(left, 1.0))
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            address = f"{peer[0]}:{peer[1]}"
            try:
                channel = server_handshake(sock, self._secret)
                hello = channel.recv(timeout_s=5.0)
            except (OSError, ValueError) as exc:  # AuthenticationError, TimeoutError, bad frames
                logger.warning("refused a tensor-parallel peer from %s: %s", address, exc)
                sock.close()
                continue
            node = self._welcome(channel, hello, address, mine, store_port, num_blocks)
            if node is not None:
                self.nodes[node.node_rank] = node
                logger.info("tensor-parallel %s joined", node.name())
        return [self.nodes[k] for k in sorted(self.nodes)]

    def _welcome(self, channel, hello, address, mine, store_port, num_blocks) -> RemoteNode | None:
        dist = self.config.dist
        problem = None
        if not (isinstance(hello, list) and len(hello) == 3 and hello[0] == "hello"):
            problem = "expected a hello message"
        elif not (isinstance(hello[1], int) and 1 <= hello[1] < dist.nnodes):
            problem = f"--node-rank {hello[1]!r} is not in 1..{dist.nnodes - 1}"
        elif hello[1] in self.nodes:
            problem = f"node {hello[1]} has already joined"
        elif hello[2] != mine:
            problem = "options differ from node 0's: " + describe_mismatch(mine, hello[2])
        if problem is not None:
            logger.warning("refused tensor-parallel node from %s: %s", address, problem)
            try:
                channel.send(["error", f"node 0 refused this node: {problem}"])
            except OSError:
                pass
            channel.close()
            if "options differ" in problem:  # the same command line everywhere: fail fast
                raise NodeJoinError(f"node {hello[1]} at {address}: {problem}")
            return None
        node_rank = hello[1]
        channel.send(["welcome", self.host, store_port, num_blocks])
        ranks = dist.node_ranks(self.config.tensor_parallel_size, node_rank)
        return RemoteNode(node_rank, ranks, channel, address)

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self._listener.close()
