"""Grammar compilation that can be abandoned: each compile runs in a child process, killed past its limit.

xgrammar's compiler is a C++ call that cannot be cancelled. Run on a thread, a compile of a 20,000-value enum
kept going for 17 minutes after its request had its 400, and every grammar after it queued behind it. Here the
compile runs in a worker process forked from a `forkserver` (single-threaded, xgrammar preloaded, so a new
worker starts in a fraction of a second instead of re-importing torch); the result comes back serialised
(`CompiledGrammar.serialize_json`, ~80 KB for a small schema) and is rebuilt against the parent's
`TokenizerInfo`. A compile still running after `timeout_s` has its worker killed (SIGKILL), its caller gets
`GrammarCompileTimeoutError`, and a replacement worker is started at once so the next compile does not wait
for a start-up. Every path that compiles (the server's grammar queue through the core's check thread, the
core's own compile thread for routed requests, the offline API) goes through `GrammarCache.compile` and so
through here: the limit holds in one place.

A worker's start-up (fork + rebuilding the tokenizer info) is not counted against the limit; the compile is.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from kvserve.core.errors import InvalidRequestError
from kvserve.mp_children import children_allowed
from kvserve.structured.schema import compile_constraint

logger = logging.getLogger("kvserve.structured")

STARTUP_TIMEOUT_S = (
    300.0  # the first worker waits for the forkserver to import xgrammar (and torch)
)
MAX_IDLE_WORKERS = 1  # a second concurrent compile starts its own worker, closed when done


class GrammarCompileTimeoutError(InvalidRequestError):
    """A grammar did not compile within the engine's limit; its compile was stopped (HTTP 400)."""


class CompileWorkerError(RuntimeError):
    """No compile worker could be started (an engine fault, not the request's)."""


WORKER_PROCESS_NAME = (
    b"kvserve-grammar"  # its /proc/PID/comm (at most 15 bytes), for operators and tests
)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent (the forkserver, which exits with the engine) dies, so a
    compile in progress never outlives the engine; and name the process."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(WORKER_PROCESS_NAME))


def _worker_main(conn: Connection, tokenizer_info_json: str) -> None:
    """The worker: rebuild the tokenizer info, say ready, then compile (kind, spec) pairs until EOF."""
    _die_with_parent()
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", compile_constraint(compiler, kind, spec).serialize_json())
        except Exception as exc:  # the constraint's own error, reported to the caller
            reply = ("error", type(exc).__name__, str(exc))
        conn.send(reply)


class _Worker:
    def __init__(self, process, conn: Connection, pid: int) -> None:
        self.process = process
        self.conn = conn
        self.pid = pid

    def close(self) -> None:
        self.conn.close()  # the worker sees EOF and exits
        self.process.join(5.0)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5.0)
        self.conn.close()


class IsolatedCompiler:
    """Compiles constraints in worker processes; returns `CompiledGrammar.serialize_json()` text.

    `compile` raises GrammarCompileTimeoutError past `timeout_s`, ValueError with the compiler's message for
    an invalid constraint, CompileWorkerError when no worker starts. Thread-safe: concurrent compiles get
    workers of their own."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the grammar compile timeout must be > 0 s, got {timeout_s}")
        self.timeout_s = timeout_s
        self._info_json = tokenizer_info_json
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["xgrammar"])
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._num_starting = 0
        self._num_waiting = 0
        self._closed = False
        self._num_start_failures = 0
        self._start_error: str = ""
        # counters, for tests and /metrics
        self.num_started = 0
        self.num_killed = 0
        self.killed_pids: list[int] = []

    def prestart(self) -> None:
        """Start a worker in the background (so that the first compile finds one ready)."""
        with self._cond:
            if not self._idle and self._num_starting == 0:
                self._start_worker()

    def compile(self, kind: str, spec: str, timeout_s: float | None = None) -> str:
        limit = self.timeout_s if timeout_s is None else timeout_s
        worker = self._checkout()
        start = time.monotonic()
        try:
            worker.conn.send((kind, spec))
            finished = worker.conn.poll(limit)
            reply = worker.conn.recv() if finished else None
        except (EOFError, OSError) as exc:  # the worker died (out of memory, killed)
            self._discard(worker)
            raise CompileWorkerError(f"the grammar compile worker died: {exc!r}") from None
        if reply is None:
            self._abandon(worker, time.monotonic() - start)
            raise GrammarCompileTimeoutError(
                f"the structured-output grammar did not compile within the server's {limit:g} s "
                "limit (--grammar-compile-timeout) and was abandoned; simplify the constraint "
                "(fewer enum values or choices, a shorter schema)"
            )
        self._checkin(worker)
        if reply[0] == "ok":
            return reply[1]
        raise ValueError(reply[2])

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()

    @property
    def num_live_workers(self) -> int:
        with self._cond:
            return len(self._idle)

    # --- workers ---------------------------------------------------------------------------------------

    def _checkout(self) -> _Worker:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self._cond:
            failures_before = self._num_start_failures
            self._num_waiting += 1
            try:
                while not self._idle:
                    if self._closed:
                        raise CompileWorkerError("the grammar compiler is shut down")
                    if self._num_start_failures != failures_before:  # no retry loop
                        raise CompileWorkerError(
                            f"no grammar compile worker could be started: {self._start_error}"
                        )
                    if self._num_starting < self._num_waiting:
                        self._start_worker()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CompileWorkerError(
                            f"no grammar compile worker started within {STARTUP_TIMEOUT_S:g} s"
                        )
                    self._cond.wait(remaining)
                return self._idle.pop()
            finally:
                self._num_waiting -= 1

    def _checkin(self, worker: _Worker) -> None:
        with self._cond:
            if not self._closed and len(self._idle) < MAX_IDLE_WORKERS:
                self._idle.append(worker)
                self._cond.notify()
                return
        worker.close()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self.prestart()

    def _abandon(self, worker: _Worker, elapsed_s: float) -> None:
        logger.warning(
            "grammar compile abandoned after %.1f s (limit %g s): killing worker %d",
            elapsed_s,
            self.timeout_s,
            worker.pid,
        )
        worker.kill()
        with self._cond:
            self.num_killed += 1
            self.killed_pids.append(worker.pid)
        self.prestart()  # the replacement starts now, not when the next grammar arrives

    def _start_worker(self) -> None:
        """Under the lock: start one worker on a thread (a forkserver start blocks until it has
        imported xgrammar); it joins `_idle` when ready."""
        self._num_starting += 1
        threading.Thread(target=self._run_start, name="kvserve-grammar-start", daemon=True).start()

    def _run_start(self) -> None:
        worker, error = None, ""
        try:
            parent_conn, child_conn = self._ctx.Pipe()
            process = self._ctx.Process(
                target=_worker_main,
                args=(child_conn, self._info_json),
                daemon=True,
                name="kvserve-grammar-worker",
            )
            with children_allowed():  # an engine core is a daemonic process
                process.start()
            child_conn.close()
            if not parent_conn.poll(STARTUP_TIMEOUT_S):
                process.kill()
                raise CompileWorkerError("the grammar compile worker did not start")
            _, pid = parent_conn.recv()
            worker = _Worker(process, parent_conn, pid)
        except Exception as exc:
            logger.exception("starting a grammar compile worker failed")
            error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            self._num_starting -= 1
            if worker is None:
                self._num_start_failures += 1
                self._start_error = error
            if worker is not None:
                self.num_started += 1
                if self._closed:
                    worker.close()
                else:
                    self._idle.append(worker)
            self._cond.notify_all()
