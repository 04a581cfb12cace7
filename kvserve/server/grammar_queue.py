"""Structured-output requests wait for their grammar's compilation here, not in the worker pool.

Compiling a grammar can take tens of seconds (a 50,000-way `guided_choice`: ~25 s). A request whose grammar
the engine has not compiled yet must not hold a worker of the shared pool while it waits (five of them
would starve every plain request), nor queue a tiny regex behind large ones. Here such a request waits on
the event loop, as a coroutine, for its turn; one is started at a time (the engine core compiles its
grammar when it adds the request, and accepts it once compiled), and the smallest constraint goes
first, so a small grammar waits for at most the compilation already running. Smallest first, with ageing: a request's place is its arrival
time plus 0.1 ms per byte of its constraint, so a 500 KB grammar lets newer small ones pass for 50 s, not
for ever. The engine's compile time limit then counts compilation, not the queue. Beyond `max_waiting`
queued grammars a request gets a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import heapq
import inspect
import itertools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve.server.errors import APIError

AGEING_S_PER_BYTE = 1e-4


class GrammarQueue:
    def __init__(self, max_waiting: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_waiting = max_waiting
        self._clock = clock
        self._busy = False
        self._waiting: list[tuple[float, int, asyncio.Future]] = []  # (place, arrival, wake-up)
        self._order = itertools.count()
        self._thread: ThreadPoolExecutor | None = None

    @property
    def num_waiting(self) -> int:
        return sum(not future.done() for _, _, future in self._waiting)

    async def run(self, size: int, fn: Callable[..., Any], *args) -> Any:
        """Run `fn(*args)` when this request's turn comes (`size`: the constraint's bytes): awaited
        here if it is a coroutine function (the server's: start the request and wait until the engine
        core has compiled its grammar and accepted it), else on the grammar thread."""
        async with self._turn(size):
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
            call = functools.partial(contextvars.copy_context().run, fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    @contextlib.asynccontextmanager
    async def _turn(self, size: int) -> AsyncIterator[None]:
        if self._busy:
            if self.num_waiting >= self.max_waiting:
                raise APIError(
                    429,
                    f"{self.max_waiting} structured-output grammars are already waiting to compile; "
                    "retry shortly",
                    "rate_limit_error",
                    code="grammar_queue_full",
                    headers={"Retry-After": "5"},
                )
            wake = asyncio.get_running_loop().create_future()
            place = self._clock() + size * AGEING_S_PER_BYTE
            heapq.heappush(self._waiting, (place, next(self._order), wake))
            try:
                await wake
            except asyncio.CancelledError:
                if wake.done() and not wake.cancelled():
                    self._hand_on()  # the turn came, but the request left: pass it on
                raise
        else:
            self._busy = True
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        while self._waiting:
            _, _, wake = heapq.heappop(self._waiting)
            if not wake.done():  # a request that left while waiting is skipped
                wake.set_result(None)
                return
        self._busy = False
