"""The asyncio front end: the engine loop runs in its own thread so HTTP handling never waits on a forward.

Requests and aborts are queued as commands and applied between steps; each step's outputs are handed to the
per-request asyncio queues with `call_soon_threadsafe`. An abort (client gone, timeout) therefore takes effect
before the next step, and its blocks return to the pool then.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvserve.core.errors import KVServeError
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.step_log import StepLog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot published by the engine thread after every step (read by /ready and /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    spec_num_verify_steps: int = 0
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0
    spec_num_emitted: int = 0
    spec_draft_time_s: float = 0.0
    spec_target_time_s: float = 0.0


class EngineDeadError(KVServeError):
    """The engine loop stopped on an internal error; the server reports 503 from then on."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_step: Callable[[list[RequestOutput]], None] | None = None
    ):
        self.engine = engine
        self.on_step = on_step
        self._commands: deque[tuple] = deque()
        self._wakeup = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._num_pending_adds = 0
        self._stopping = False
        self.error: BaseException | None = None
        self.stats = self._collect_stats()
        self.step_log = StepLog()  # per-iteration timings (simulator calibration)
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    # --- public -----------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet admitted by the scheduler (including ones not yet handed over)."""
        return self.stats.num_waiting + self._num_pending_adds

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.engine.validate(prompt_token_ids, params)  # reads only immutable configuration

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream snapshots of one request until it finishes. Leaving early (client disconnect, timeout,
        cancellation) aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.error!r}")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._queues:
            raise KVServeError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._submit(
            ("add", request_id, prompt_token_ids, params, prompt, cache_salt, arrival_time)
        )
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        with self._wakeup:
            self._wakeup.notify()
        self._thread.join(timeout_s)

    def call_in_engine_thread(self, fn: Callable[[LLMEngine], object], timeout_s: float = 30.0):
        """Run `fn(engine)` between steps and return its result (for maintenance such as warm-up)."""
        done = threading.Event()
        box: list = []

        def task(engine: LLMEngine) -> None:
            try:
                box.append((True, fn(engine)))
            except BaseException as exc:  # handed back to the caller
                box.append((False, exc))
            done.set()

        self._submit(("call", task))
        if not done.wait(timeout_s):
            raise TimeoutError("the engine thread did not run the call in time")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    # --- engine thread ----------------------------------------------------------------------------------

    def _submit(self, command: tuple) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._num_pending_adds += command[0] == "add"
            self._wakeup.notify()

    def _next_command(self) -> tuple | None:
        with self._wakeup:
            if not self._commands:
                return None
            command = self._commands.popleft()
            self._num_pending_adds -= command[0] == "add"
            return command

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their requests' queues with one wake-up per event loop, not one per item
        (each `call_soon_threadsafe` writes to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            entry = self._queues.get(request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the event loop has closed (shutdown)
                pass

    def _apply_commands(self) -> None:
        while (command := self._next_command()) is not None:
            kind = command[0]
            if kind == "add":
                _, request_id, prompt_ids, params, prompt, salt, arrival = command
                if request_id not in self._queues:
                    continue  # the caller gave up before the request reached the engine
                try:
                    self.engine.add_request(
                        request_id,
                        prompt_ids,
                        params,
                        prompt=prompt,
                        cache_salt=salt,
                        arrival_time=arrival,
                    )
                except KVServeError as exc:
                    self._deliver(request_id, exc)
            elif kind == "abort":
                self.engine.abort_request(command[1])
            elif kind == "call":
                command[1](self.engine)

    def _run(self) -> None:
        try:
            clock = time.perf_counter
            while True:
                slept_s = 0.0
                with self._wakeup:
                    while not self._commands and not self.engine.has_unfinished_requests():
                        if self._stopping:
                            return
                        t_sleep = clock()
                        self._wakeup.wait()
                        slept_s += clock() - t_sleep
                    if self._stopping and not self.engine.has_unfinished_requests():
                        return
                t0 = clock()
                self._apply_commands()
                t1 = clock()
                outputs = self.engine.step()
                t2 = clock()
                self.stats = self._collect_stats()
                if self.on_step is not None:
                    self.on_step(outputs)
                self._deliver_all([(output.request_id, output) for output in outputs])
                self._log_step(slept_s, t0, t1, t2, clock())
        except BaseException as exc:  # a bug in the engine: fail every waiting request, loudly
            logger.exception("engine loop failed")
            self.error = exc
            dead = EngineDeadError(f"the engine loop stopped: {exc!r}")
            self._deliver_all([(request_id, dead) for request_id in list(self._queues)])

    def _log_step(self, slept_s: float, t0: float, t1: float, t2: float, t3: float) -> None:
        last = self.engine.last_scheduler_output
        chunks = (
            () if last is None else tuple((c.num_tokens, c.start_position) for c in last.chunks)
        )
        # slept: only the time asleep waiting for work (idle), never lock or interpreter waits
        self.step_log.record(t0, slept_s, t1 - t0, t2 - t1, t3 - t2, chunks)

    def _collect_stats(self) -> EngineStats:
        engine = self.engine
        scheduler = engine.scheduler
        kv = engine.kv_manager
        spec = engine.runner.spec_stats
        return EngineStats(
            spec_num_verify_steps=spec.num_verify_steps,
            spec_num_proposed=spec.num_proposed,
            spec_num_accepted=spec.num_accepted,
            spec_num_emitted=spec.num_emitted,
            spec_draft_time_s=spec.draft_time_s,
            spec_target_time_s=spec.target_time_s,
            num_running=scheduler.num_running,
            num_waiting=engine.num_waiting_samples,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            num_preemptions=scheduler.stats.num_preemptions,
            prefix_cache_queries=kv.stats.num_queries,
            prefix_cache_hits=kv.stats.num_hits,
            num_steps=scheduler.stats.num_steps,
        )


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
