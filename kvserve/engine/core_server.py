"""`kvserve engine-core`: one engine core on this host, served to an API server on another host over TCP
(docs/parallel.md, "Engine cores on other hosts"; the API server's side is kvserve.engine.remote).

This process is a relay. It starts the engine core exactly as a local API server does
(kvserve.engine.core_proc.run_core in a spawned child, over two ZMQ ipc sockets), listens on
`--host:--port` (that address only), and admits one API server that proves the shared secret
(kvserve.links's HMAC challenge/response; a peer that does not is dropped having read only a
random challenge). It then passes the core's messages through unchanged, each in an authenticated
frame: the API server's commands to the core, the core's Ready, outputs and heartbeats back (a Ready
sent before the API server arrived is kept for it). The relay decodes nothing on the way once a
session is up.

One API server at a time: another that proves the secret meanwhile is told why and dropped. The core
lives as long as its API server's connection (as a local core lives as long as its API server): when
the connection ends (the server shut down, or its host vanished: a send then fails within the TCP
user timeout) the core is stopped and this command exits. When the core's process dies the API server
is told (its requests fail with 503 there) and this command exits 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading

from kvserve.engine.core_proc import run_core
from kvserve.engine.remote import CORE_MAGIC, tune_link
from kvserve.engine.wire import CoreOutputs, FromCore, Heartbeat, ShutdownCmd, decoder, encoder
from kvserve.links import Channel, listen, server_handshake

logger = logging.getLogger(__name__)


class CoreServer:
    """The relay between one local engine-core process and one authenticated API server."""

    def __init__(self, config, host: str, port: int, secret: bytes, faults=None) -> None:
        import zmq

        self._listener = listen(host, port, flag="--host/--port")
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._secret = secret
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)  # the session's reader's, and the exit's
        self._to_core_lock = threading.Lock()  # a ZMQ socket is not thread-safe
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_core,
            args=(
                config,
                faults,
                f"ipc://{self._dir}/in",
                f"ipc://{self._dir}/out",
                0,
                os.getpid(),
                logging.getLevelName(logging.getLogger().level),
            ),
            name="kvserve-core-0",
            daemon=True,
        )
        self._lock = threading.Lock()  # the session and the messages kept for it change together
        self._session: Channel | None = None
        self._early: list[bytes] = []  # the core's Ready (or load failure) before a server came
        self._session_over = threading.Event()
        self._stopping = False

    def run(self) -> int:
        """Serve until the API server leaves (0) or the core dies (1)."""
        import zmq

        self._proc.start()
        logger.info("engine core on %s: loading (pid %d)", self.address, self._proc.pid)
        threading.Thread(target=self._accept, name="kvserve-accept", daemon=True).start()
        dec = decoder(FromCore)
        try:
            while True:
                if self._proc.exitcode is not None:
                    return self._core_exited(self._proc.exitcode)
                if self._session_over.is_set():
                    logger.info("the API server left: stopping the engine core")
                    return 0
                if not self._from_core.poll(200):
                    continue
                try:
                    _, data = self._from_core.recv_multipart()
                except zmq.ZMQError:
                    continue
                with self._lock:
                    session = self._session
                    if session is None:
                        if not isinstance(dec.decode(data), Heartbeat):
                            self._early.append(data)
                        continue
                self._forward(session, data)
        finally:
            self._close()

    def _forward(self, session: Channel, data: bytes) -> None:
        try:
            session.send_bytes(data)
        except OSError as exc:
            logger.warning("sending to the API server failed: %s", exc)
            self._session_over.set()

    def _core_exited(self, code: int) -> int:
        if code == 0:
            logger.info("the engine core stopped")
            return 0
        reason = f"engine core on {self.address} exited with code {code}"
        logger.error("%s", reason)
        with self._lock:
            session = self._session
        if session is not None:  # its requests fail with this reason on the API server
            self._forward(session, encoder().encode(CoreOutputs(dead_reason=reason)))
        return 1

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed at exit
            try:
                channel = server_handshake(sock, self._secret, CORE_MAGIC)
            except (OSError, ValueError) as exc:  # wrong secret, garbage, a stalled peer
                logger.warning("refused %s:%d: %s", peer[0], peer[1], exc)
                sock.close()
                continue
            tune_link(sock)
            with self._lock:
                if self._session is not None:
                    busy = f"the engine core on {self.address} already serves an API server"
                    logger.warning("refused %s:%d: %s", peer[0], peer[1], busy)
                    _tell_and_close(channel, busy)
                    continue
                for data in self._early:  # in order, before anything newer
                    channel.send_bytes(data)
                self._early.clear()
                self._session = channel
            logger.info("API server %s:%d connected", peer[0], peer[1])
            threading.Thread(
                target=self._relay_commands, args=(channel,), name="kvserve-commands", daemon=True
            ).start()

    def _relay_commands(self, channel: Channel) -> None:
        try:
            while True:
                data = channel.recv_bytes()
                with self._to_core_lock:
                    self._to_core.send(data)
        except (OSError, ValueError) as exc:
            if not self._stopping:
                logger.info("the API server's connection ended: %s", exc)
        finally:
            self._session_over.set()

    def _close(self) -> None:
        import zmq

        self._stopping = True
        self._listener.close()
        with self._lock:
            if self._session is not None:
                self._session.close()
        if self._proc.exitcode is None:
            try:  # never blocks: a core that already left has no queue to wait on
                with self._to_core_lock:
                    self._to_core.send(encoder().encode(ShutdownCmd()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # best effort: it is killed below
                pass
            self._proc.join(5)
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join(2)
        with self._to_core_lock:
            self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _tell_and_close(channel: Channel, reason: str) -> None:
    try:
        channel.send_bytes(encoder().encode(CoreOutputs(dead_reason=reason)))
    except OSError:
        pass
    try:
        channel.sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    channel.close()
