"""The multi-process `EngineClient`: N engine-core processes (kvserve.engine.core_proc) over ZMQ.

The front end binds one PUSH socket per core (commands) and one PULL socket that every core pushes its
outputs to (framed with the core's index); messages are msgspec-encoded (kvserve.engine.wire). A receiver
thread decodes outputs and accumulates them for the event loop; a monitor thread watches every core:
a process that exits, or sends nothing for `heartbeat_timeout_s` (it beats every 0.5 s from its own
thread), is dead. A dead core is taken out of rotation and its requests fail with 503; when the last one
dies the client is dead and `on_dead` is called (the server then exits non-zero).

With `num_cores` > 1 (data parallel) each request goes to the core that saw its first prompt block
before (its prefix is likely cached there), else to the least loaded core.

`remote_cores` adds engine cores on other hosts (`kvserve engine-core`, kvserve.engine.remote): each is
one authenticated TCP link, read by a thread of its own, and is otherwise a core like the local ones
(indices after them): the same messages, routing, heartbeats and death.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from kvserve.engine.client import CoreHandle, EngineClient
from kvserve.engine.remote import RemoteCore, RemoteCoreError, check_same_model, connect_all
from kvserve.engine.wire import (
    CoreOutputs,
    EngineDeadError,
    FromCore,
    Heartbeat,
    Ready,
    ShutdownCmd,
    decoder,
    encoder,
)
from kvserve.tokenizer import load_api_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


class MPClient(EngineClient):
    def __init__(
        self,
        config,
        *,
        num_cores: int = 1,
        remote_cores: Sequence[str] = (),
        faults=None,
        on_dead: Callable[[str], None] | None = None,
        heartbeat_timeout_s: float | None = None,
        startup_timeout_s: float = 900.0,
    ) -> None:
        """Long: starting N core processes and their sockets is one transaction: every failure path
        closes what was opened before it."""
        import zmq

        if num_cores < 0 or num_cores + len(remote_cores) < 1:
            raise ValueError(f"the number of engine cores must be >= 1, got {num_cores}")
        # before any process or socket: a tokenizer that cannot be read leaves nothing to close
        tokenizer = load_api_tokenizer(config.model_dir)
        # first: a core that cannot be reached fails the start before any local core loads
        links = connect_all(list(remote_cores), config.dist.secret_file, config.dist.timeout_s)
        env_timeout = os.environ.get("KVSERVE_HEARTBEAT_TIMEOUT_S")
        self.heartbeat_timeout_s = heartbeat_timeout_s or float(
            env_timeout or DEFAULT_HEARTBEAT_TIMEOUT_S
        )
        self._dir = tempfile.mkdtemp(prefix="kvserve-ipc-")
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        out_address = f"ipc://{self._dir}/out"
        self._pull.bind(out_address)
        self._pushes, self._send_locks, self._procs = [], [], []
        self._last_seen: list[float] = []
        self._ready: dict[int, Ready] = {}
        self._startup_error: str | None = None
        self._started = threading.Event()
        self._stopping = False
        self._enc = encoder()
        cores = []
        spawn = multiprocessing.get_context("spawn")
        from kvserve.engine.core_proc import run_core

        for index in range(num_cores):
            push = self._ctx.socket(zmq.PUSH)
            in_address = f"ipc://{self._dir}/in{index}"
            push.bind(in_address)
            self._pushes.append(push)
            self._send_locks.append(threading.Lock())
            self._last_seen.append(time.monotonic())
            cores.append(CoreHandle(index, lambda cmd, i=index: self._send(i, cmd)))
            proc = spawn.Process(
                target=run_core,
                args=(
                    config,
                    faults,
                    in_address,
                    out_address,
                    index,
                    os.getpid(),
                    logging.getLevelName(logging.getLogger().level),
                ),
                name=f"kvserve-core-{index}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        self._remotes: dict[int, RemoteCore] = {}
        for index, link in enumerate(links, start=num_cores):
            self._remotes[index] = link
            self._last_seen.append(time.monotonic())
            cores.append(CoreHandle(index, lambda cmd, link=link: link.send(self._enc.encode(cmd))))
            cores[-1].address = link.address
        super().__init__(None, tokenizer, cores, on_dead=on_dead)
        self._receiver = threading.Thread(
            target=self._receive, name="kvserve-client-recv", daemon=True
        )
        self._receiver.start()
        for index, link in self._remotes.items():
            threading.Thread(
                target=self._receive_remote,
                args=(index, link),
                name=f"kvserve-client-recv{index}",
                daemon=True,
            ).start()
        threading.Thread(target=self._monitor, name="kvserve-client-monitor", daemon=True).start()
        if not self._started.wait(startup_timeout_s):
            self.shutdown()
            raise TimeoutError(f"the engine cores did not start in {startup_timeout_s:g} s")
        if self._startup_error is not None:
            self.shutdown()
            raise RuntimeError(f"engine core failed to start: {self._startup_error}")
        try:
            check_same_model([(self._name(c), self._ready[c.index].info) for c in self._cores])
        except RemoteCoreError:
            self.shutdown()
            raise
        self.info = self._ready[0].info

    @property
    def core_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _send(self, index: int, command) -> None:
        data = self._enc.encode(command)
        with self._send_locks[index]:
            self._pushes[index].send(data)

    def _receive(self) -> None:
        import zmq

        dec = decoder(FromCore)
        while not self._stopping:
            try:
                if not self._pull.poll(200):
                    continue
                tag, data = self._pull.recv_multipart()
            except zmq.ZMQError:
                return  # closed at shutdown
            self._handle(int(tag), dec.decode(data))

    def _receive_remote(self, index: int, link: RemoteCore) -> None:
        dec = decoder(FromCore)
        while not self._stopping:
            try:
                message = dec.decode(link.recv())
            except (OSError, ValueError) as exc:  # closed, refused frame, undecodable
                if not self._stopping:
                    link.lose(f"connection lost: {exc}")
                return
            self._handle(index, message)

    def _handle(self, index: int, message) -> None:
        self._last_seen[index] = time.monotonic()
        if isinstance(message, Heartbeat):
            return
        if isinstance(message, Ready):
            self._ready[index] = message
            self._cores[index].pid = message.pid
            if len(self._ready) == len(self._cores):
                self._started.set()
            return
        assert isinstance(message, CoreOutputs)
        if not self._started.is_set():
            if message.dead_reason is not None:
                self._startup_error = message.dead_reason
                self._started.set()
            return
        try:
            self._on_core_outputs(self._cores[index], message)
        except Exception:  # a bug here must not silence every stream
            logger.exception("processing engine core %d's outputs failed", index)

    def _monitor(self) -> None:
        while not self._stopping:
            time.sleep(0.1)
            for core in self._cores:
                if not core.alive or self._stopping:
                    continue
                link = self._remotes.get(core.index)
                proc = self._procs[core.index] if link is None else None
                if proc is not None and proc.exitcode is not None:
                    reason = f"{self._name(core)} exited with code {proc.exitcode}"
                elif link is not None and link.lost_reason is not None:
                    reason = f"{self._name(core)}: {link.lost_reason}"
                elif time.monotonic() - self._last_seen[core.index] > self.heartbeat_timeout_s:
                    reason = (
                        f"{self._name(core)} missed its heartbeat for "
                        f"{self.heartbeat_timeout_s:g} s"
                    )
                    if link is None:
                        proc.kill()
                    else:
                        link.lose("missed its heartbeat")
                else:
                    continue
                logger.critical("%s", reason)
                if not self._started.is_set():
                    self._startup_error = reason
                    self._started.set()
                    continue
                self._core_died(core, reason)

    def _name(self, core: CoreHandle) -> str:
        link = self._remotes.get(core.index)
        if link is not None:
            return f"remote engine core {core.index} ({link.address})"
        return f"engine core {core.index} (pid {self._procs[core.index].pid})"

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        for link in self._remotes.values():  # the core stops when its API server leaves
            link.send(self._enc.encode(ShutdownCmd()))
            link.close()
        for index, proc in enumerate(self._procs):
            if proc.exitcode is None:
                try:
                    self._send(index, ShutdownCmd())
                except Exception:  # noqa: BLE001 - best effort: it is killed below
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(2)
        self._receiver.join(2)
        for push in self._pushes:
            push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.dead_reason is None:
            self.dead_reason = "the engine client was shut down"


__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT_S", "EngineDeadError", "MPClient"]
