"""Engine cores on other hosts, the API server's side (docs/parallel.md, "Engine cores on other hosts").

`kvserve engine-core` (kvserve.engine.core_server) runs one engine core on its own host and listens on
`--host:--port`. The API server (`kvserve serve --remote-engine-core HOST:PORT`) connects to it, and
both prove the shared secret with the tensor-parallel nodes' HMAC challenge/response
(kvserve.links; this protocol greets with its own magic, so neither side mistakes the other
kind of port). Every later frame is the same msgpack message (kvserve.engine.wire) a local core
exchanges over ZMQ, carried in an HMAC-tagged frame (direction, sequence number, payload): a frame
injected, replayed or reordered by anyone without the secret is refused. Nothing is encrypted.

`RemoteCore` is the link; MPClient (kvserve.engine.mp_client) reads from it on a thread of its own and
treats the core like a local one: the same routing, heartbeats and `_core_died`.
"""

from __future__ import annotations

import socket
import struct
import time

from kvserve.core.errors import InvalidRequestError
from kvserve.engine.wire import EngineInfo
from kvserve.links import (
    AuthenticationError,
    Channel,
    client_handshake,
    connect,
    load_secret,
)

CORE_MAGIC = b"KVSERVE-CORE/1\n"
SECRET_NEEDED_BY = "an engine core on another host (--remote-engine-core, kvserve engine-core)"
# A link whose peer stops acknowledging (its host vanished, the cable is cut) fails a send after this,
# instead of TCP's default of about 15 minutes of retransmissions; heartbeats notice it sooner.
TCP_USER_TIMEOUT_S = 20.0
SEND_TIMEOUT_S = 5.0  # a send blocked this long (the peer's window full) fails and drops the link
# What every core behind one API server must share: the server tokenises and routes for all of them.
SAME_MODEL_FIELDS = (
    "model_type",
    "vocab_size",
    "num_layers",
    "max_model_len",
    "block_size",
    "dtype",
    "quantization",
    "eos_token_ids",
)


class RemoteCoreError(RuntimeError):
    """A remote engine core cannot be reached, authenticated or used; one line for the operator."""


def parse_address(text: str, flag: str = "--remote-engine-core") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(
            f"{flag} must be HOST:PORT, got {text!r}", flag.lstrip("-").replace("-", "_")
        )
    return host, int(port)


def tune_link(sock: socket.socket) -> None:
    """Bound how long a send may wait on a peer that no longer answers (both sides of a link)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(TCP_USER_TIMEOUT_S * 1000))
    timeval = struct.pack("ll", int(SEND_TIMEOUT_S), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class RemoteCore:
    """The API server's authenticated link to one `kvserve engine-core`."""

    def __init__(self, address: str, channel: Channel) -> None:
        self.address = address
        self._channel = channel
        self.lost_reason: str | None = None  # set once the link is broken (by a send or the reader)

    @classmethod
    def connect(cls, address: str, secret: bytes, timeout_s: float) -> RemoteCore:
        """Connect (retrying until `timeout_s`: the core may start after the server) and prove the
        secret both ways."""
        host, port = parse_address(address)
        try:
            sock = connect(host, port, time.monotonic() + timeout_s)
            channel = client_handshake(sock, secret, CORE_MAGIC, peer="the engine core")
        except TimeoutError as exc:
            raise RemoteCoreError(
                f"remote engine core {address}: not reached within {timeout_s:g} s "
                f"(--dist-timeout): {exc}"
            ) from None
        except (OSError, AuthenticationError) as exc:
            raise RemoteCoreError(f"remote engine core {address}: {exc}") from None
        tune_link(channel.sock)
        return cls(address, channel)

    def send(self, data: bytes) -> None:
        """Send one encoded message; a broken link is recorded (the monitor then fails the core's
        requests with 503), never raised into the request that happened to send."""
        if self.lost_reason is not None:
            return
        try:
            self._channel.send_bytes(data)
        except OSError as exc:
            self.lose(f"sending failed: {exc.strerror or exc}")

    def recv(self) -> bytes:
        """The next authenticated message (blocking); raises ConnectionError / AuthenticationError."""
        return self._channel.recv_bytes()

    def lose(self, reason: str) -> None:
        if self.lost_reason is None:
            self.lost_reason = reason
        self._channel.close()

    def close(self) -> None:
        self._channel.close()


def connect_all(
    addresses: list[str], secret_file: str | None, timeout_s: float
) -> list[RemoteCore]:
    """One link per address, in order; on any failure the links made so far are closed."""
    if not addresses:
        return []
    secret = load_secret(secret_file, SECRET_NEEDED_BY)
    links: list[RemoteCore] = []
    try:
        for address in addresses:
            links.append(RemoteCore.connect(address, secret, timeout_s))
    except BaseException:
        for link in links:
            link.close()
        raise
    return links


def check_same_model(infos: list[tuple[str, EngineInfo]]) -> None:
    """Every core must run the model the API server tokenises and routes for (the first one's)."""
    first_name, first = infos[0]
    for name, info in infos[1:]:
        for field in SAME_MODEL_FIELDS:
            if getattr(info, field) != getattr(first, field):
                raise RemoteCoreError(
                    f"{name} serves {field} = {getattr(info, field)!r} but {first_name} "
                    f"{getattr(first, field)!r}: every engine core behind one API server needs "
                    "the same model and engine options"
                )
