"""Authenticated links between hosts (docs/parallel.md, "Across hosts"): the kvserve-owned handshake
that admits a peer, and the channel that then carries its messages. Tensor-parallel nodes
(kvserve/runner/nodes.py) and remote engine cores (kvserve/engine/remote.py) use it; it needs
nothing of kvserve but its errors, so the API process can use it without loading the engine.

Node 0 (the engine) listens on `--dist-init-addr HOST:PORT`, bound to HOST only. A node that connects
must prove it holds the shared secret before it learns anything: node 0 sends a random challenge,
the node answers with HMAC-SHA256(secret, "client" | both nonces), node 0 answers with its own HMAC
(so a node never obeys an impostor), and both derive a session key. Every later frame carries
HMAC(session key, direction | sequence number | payload), so a frame injected, replayed or reordered
by anyone without the secret is refused. Payloads are JSON, never pickle. Only then does node 0 tell
the node where torch.distributed's store is (an ephemeral port on HOST).

What the secret does not cover: torch.distributed's TCPStore and gloo's own sockets carry no
authentication (anyone who can reach their ports can disturb the rendezvous or a collective), and
nothing is encrypted. Run the nodes on a private network; see docs/parallel.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from kvserve.core.errors import InvalidRequestError

SECRET_ENV = "KVSERVE_DIST_SECRET"
MAGIC = b"KVSERVE-TP/1\n"
NONCE_BYTES = 32
TAG_BYTES = 32
MAX_FRAME_BYTES = 64 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 5.0  # a peer that connects and then stalls is dropped after this


class AuthenticationError(ConnectionError):
    """The peer did not prove the shared secret (or a frame's tag is wrong)."""


def load_secret(secret_file: str | None, needed_by: str = "--nnodes > 1") -> bytes:
    """The shared secret: the file's contents (stripped), else $KVSERVE_DIST_SECRET. Never a flag's
    value: a command line is visible to every user of the host (`ps`). `needed_by` names what asks
    for it in the error (also engine cores on other hosts: kvserve.engine.remote)."""
    if secret_file is not None:
        value = Path(secret_file).read_bytes().strip()
    else:
        value = os.environ.get(SECRET_ENV, "").encode()
    if len(value) < 16:
        raise InvalidRequestError(
            f"{needed_by} needs a shared secret of at least 16 bytes on every host: set {SECRET_ENV} "
            "or pass --dist-secret-file FILE (e.g. `openssl rand -hex 32`)",
            "dist_secret_file",
        )
    return value


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        chunk = sock.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class Channel:
    """Authenticated frames over one TCP connection: [length u32][payload][tag]. `send` / `recv`
    carry JSON; `send_bytes` / `recv_bytes` any bytes (an engine core's msgpack messages). Sending
    is thread-safe; receive from one thread."""

    def __init__(self, sock: socket.socket, key: bytes, is_server: bool) -> None:
        self.sock = sock
        self._key = key
        self._out, self._in = (b"S", b"C") if is_server else (b"C", b"S")
        self._sent = self._received = 0
        self._send_lock = threading.Lock()  # the sequence number and the frame go together

    @property
    def peer(self) -> str:
        try:
            name = self.sock.getpeername()
        except OSError:
            return "?"
        return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "a local peer"

    def fileno(self) -> int:  # multiprocessing.connection.wait accepts the channel
        return self.sock.fileno()

    def send(self, message) -> None:
        self.send_bytes(json.dumps(message, separators=(",", ":")).encode())

    def send_bytes(self, payload: bytes) -> None:
        with self._send_lock:
            tag = _mac(self._key, self._out, struct.pack("<Q", self._sent), payload)
            self._sent += 1
            self.sock.sendall(struct.pack("<I", len(payload)) + payload + tag)

    def recv(self, timeout_s: float | None = None):
        """The next message; raises ConnectionError on EOF, TimeoutError, AuthenticationError."""
        return json.loads(self.recv_bytes(timeout_s))

    def recv_bytes(self, timeout_s: float | None = None) -> bytes:
        """The next frame's payload, authenticated; raises as `recv`."""
        self.sock.settimeout(timeout_s)
        try:
            (length,) = struct.unpack("<I", _recv_exact(self.sock, 4))
            if length > MAX_FRAME_BYTES:
                raise AuthenticationError(f"frame of {length} bytes refused")
            payload = _recv_exact(self.sock, length)
            tag = _recv_exact(self.sock, TAG_BYTES)
        except TimeoutError:
            raise TimeoutError(f"no message from {self.peer} within {timeout_s} s") from None
        finally:
            self.sock.settimeout(None)
        want = _mac(self._key, self._in, struct.pack("<Q", self._received), payload)
        if not hmac.compare_digest(tag, want):
            raise AuthenticationError(f"a frame from {self.peer} failed authentication")
        self._received += 1
        return payload

    def readable(self, timeout_s: float = 0.0) -> bool:
        import select

        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _keepalive(sock: socket.socket) -> None:
    """Notice a vanished peer on an idle connection within about 20 s."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):  # a socketpair in the tests
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def server_handshake(sock: socket.socket, secret: bytes, magic: bytes = MAGIC) -> Channel:
    """Node 0's side (or an engine core's: `magic` names the protocol). Raises
    AuthenticationError (or ConnectionError / TimeoutError) on a peer that does not prove the
    secret; it has then learned nothing but a random challenge."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(magic + server_nonce)
        answer = _recv_exact(sock, NONCE_BYTES + TAG_BYTES)
        client_nonce, tag = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(tag, _mac(secret, b"client", server_nonce, client_nonce)):
            raise AuthenticationError("the peer does not hold the shared secret")
        sock.sendall(_mac(secret, b"server", server_nonce, client_nonce))
    except TimeoutError:
        raise TimeoutError("the peer stalled in the handshake") from None
    sock.settimeout(None)
    _keepalive(sock)
    return Channel(sock, _mac(secret, b"session", server_nonce, client_nonce), is_server=True)


def client_handshake(
    sock: socket.socket, secret: bytes, magic: bytes = MAGIC, peer: str = "node 0"
) -> Channel:
    """A node's side; raises AuthenticationError when node 0 (`peer`, speaking `magic`) cannot
    prove the secret either."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = _recv_exact(sock, len(magic) + NONCE_BYTES)
        if not hello.startswith(magic):
            what = "tensor-parallel node 0" if magic == MAGIC else peer
            raise AuthenticationError(f"the peer is not a kvserve {what}")
        server_nonce = hello[len(magic) :]
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
        try:
            tag = _recv_exact(sock, TAG_BYTES)
        except ConnectionError:
            raise AuthenticationError(
                f"{peer} refused this node's secret (is the same secret set on every node?)"
            ) from None
        if not hmac.compare_digest(tag, _mac(secret, b"server", server_nonce, client_nonce)):
            raise AuthenticationError(f"{peer} does not hold the shared secret")
    except TimeoutError:
        raise TimeoutError(f"{peer} stalled in the handshake") from None
    sock.settimeout(None)
    _keepalive(sock)
    return Channel(sock, _mac(secret, b"session", server_nonce, client_nonce), is_server=False)


def listen(host: str, port: int, flag: str = "--dist-init-addr") -> socket.socket:
    """A listening socket on exactly `host` (never all interfaces unless HOST says 0.0.0.0);
    `flag` names the option that gave the address in the error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidRequestError(
            f"cannot listen on {flag} {host}:{port}: {exc.strerror} (kvserve binds the "
            "address it is given: use one of this host's addresses and a free port)",
            flag.lstrip("-").replace("-", "_"),
        ) from None
    sock.listen(64)
    return sock


def connect(host: str, port: int, deadline: float) -> socket.socket:
    """Connect to node 0, retrying until `deadline` (node 0 may start after this node)."""
    last = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((host, port), timeout=2.0)
        except OSError as exc:
            last = exc
            time.sleep(0.25)
    raise TimeoutError(f"could not reach node 0 at {host}:{port} ({last})")


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 `address` (gloo binds its sockets to it), or None."""
    if address in ("", "0.0.0.0") or ":" in address:
        return None
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    finally:
        probe.close()
    return None


def gloo_environment(address: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for ranks that talk over `address`'s interface (gloo otherwise binds to
    what the host name resolves to, which need not be on the link between the nodes). A value the
    user set is kept."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    name = interface_of(address)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}
