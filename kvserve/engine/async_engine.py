"""The in-process `EngineClient`: one engine core whose loop is a thread of this process.

The core (kvserve.engine.core.EngineCore), served by a `ServingLoop` (kvserve.engine.serving_loop),
applies queued commands between steps and hands each step's deltas to this client directly (no
encoding); the client accumulates them and wakes each request's asyncio queue with
`call_soon_threadsafe`. An abort (client gone, timeout) therefore takes effect before the next step,
and its blocks return to the pool then. If the loop dies, every request fails with
`EngineDeadError` (a 503) and `on_dead` is called so the server can exit for a restart.

The multi-process client (kvserve.engine.mp_client) is the same interface with the core in its own
process; `kvserve serve` uses that by default.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import partial

from kvserve.engine.client import CoreHandle, EngineClient, RequestStream
from kvserve.engine.core import EngineCore
from kvserve.engine.faults import FaultInjection
from kvserve.engine.info import engine_info
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.serving_loop import ServingLoop
from kvserve.engine.wire import EngineDeadError, EngineStats, RequestFailedError

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStats", "RequestFailedError", "RequestStream"]


class AsyncEngine(EngineClient):
    def __init__(
        self,
        engine: EngineCore,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        *,
        on_dead: Callable[[str], None] | None = None,
        faults: FaultInjection | None = None,
    ):
        self.engine = engine
        core = CoreHandle(0, self._send)
        core.pid = os.getpid()
        super().__init__(engine_info(engine), engine.tokenizer, [core], on_dead=on_dead)
        core.stats = engine.collect_stats()
        self.serving_loop = ServingLoop(engine, partial(self._on_core_outputs, core), faults=faults)
        self.serving_loop.start()

    def _send(self, command) -> None:
        self.serving_loop.submit(command)

    @property
    def error(self) -> str | None:
        return self.dead_reason

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.serving_loop.shutdown(timeout_s)

    def call_in_engine_thread(self, fn: Callable[[EngineCore], object], timeout_s: float = 30.0):
        """Run `fn(engine)` between steps and return its result (in-process only: tests, maintenance)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        done = threading.Event()
        outcome: list[tuple[bool, object]] = []  # (returned, its value or exception), set by `task`

        def task(engine: EngineCore) -> None:
            try:
                outcome.append((True, fn(engine)))
            except BaseException as exc:  # handed back to the caller
                outcome.append((False, exc))
            done.set()

        self.serving_loop.submit(task)
        if not done.wait(timeout_s):
            raise TimeoutError("the engine thread did not run the call in time")
        returned, value = outcome[0]
        if not returned:
            raise value
        return value
