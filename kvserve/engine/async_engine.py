"""The asyncio front end: the engine loop runs in its own thread so HTTP handling never waits on a forward.

Requests and aborts are queued as commands and applied between steps; each step's outputs are handed to the
per-request asyncio queues with `call_soon_threadsafe`. An abort (client gone, timeout) therefore takes effect
before the next step, and its blocks return to the pool then.

Failure isolation: an exception while adding one request, or in a step that admitted new requests, is
charged to those requests (they fail with `RequestFailedError`, a 500) and the loop goes on; when several
newcomers share the failing step they are re-admitted one at a time until the culprit is found. Only a
failure that no request explains (or a broken cache invariant after recovery) stops the loop: the engine is
then dead (`EngineDeadError`, a 503) and `on_dead` is called so the server can exit for a restart.
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
from kvserve.engine.faults import DeadEngine, FaultInjection, inject_runner_fault
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


class RequestFailedError(KVServeError):
    """An internal error while preparing or running this request only; the engine goes on (HTTP 500)."""


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        *,
        on_dead: Callable[[str], None] | None = None,
        faults: FaultInjection | None = None,
    ):
        self.engine = engine
        self.on_step = on_step
        self.on_dead = on_dead
        self._commands: deque[tuple] = deque()
        self._wakeup = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Samples not yet admitted, counted exactly (under `_wakeup`): reserved by `reserve` but not yet
        # submitted, submitted but not yet handed to the engine, and waiting inside the engine.
        self._num_reserved = 0
        self._num_pending_samples = 0
        self._num_engine_waiting = 0
        self._stopping = False
        self.error: BaseException | None = None
        self.dead_reason: str | None = None
        # Adds not yet scheduled, kept so that a failing step's newcomers can be re-admitted one at a time.
        self._unscheduled: dict[str, tuple] = {}
        self._quarantine: deque[tuple] = deque()
        self._probation: str | None = None
        self._faults = faults
        self._fault_armed = False
        if faults is not None and faults.request_seed is not None:
            inject_runner_fault(engine.runner, faults.request_seed)
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
        """Samples accepted but not yet admitted by the scheduler: reserved, in flight to the engine
        thread, or in its waiting queue. Exact: every term changes under one lock."""
        with self._wakeup:
            return self._num_reserved + self._num_pending_samples + self._num_engine_waiting

    @property
    def dead(self) -> bool:
        return self.error is not None

    def reserve(self, num_samples: int, limit: int | None) -> bool:
        """Hold `num_samples` places in the waiting count if that keeps it <= `limit` (None: no limit).
        A reservation is used by `generate(..., reserved=True)` or returned with `release`."""
        with self._wakeup:
            waiting = self._num_reserved + self._num_pending_samples + self._num_engine_waiting
            if limit is not None and waiting + num_samples > limit:
                return False
            self._num_reserved += num_samples
            return True

    def release(self, num_samples: int) -> None:
        with self._wakeup:
            self._num_reserved -= num_samples

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request (compiling its grammar, if any): call it off the event loop."""
        return self.engine.validate(prompt_token_ids, params)  # reads only immutable configuration

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        reserved: bool = False,
    ) -> RequestStream:
        """Submit one request now; iterate the returned stream for its snapshots until it finishes, and
        `aclose` it to abort early. Validation happens in the engine thread (an invalid request raises
        its error from the stream); callers on an event loop validate in a worker first. `reserved`: the
        caller holds a `reserve` for `params.n` samples, which this request uses."""
        if self.error is not None:
            if reserved:
                self.release(params.n)
            raise EngineDeadError(self.dead_reason or "the engine loop stopped")
        if request_id in self._queues:
            if reserved:
                self.release(params.n)
            raise KVServeError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._submit(
            ("add", request_id, prompt_token_ids, params, prompt, cache_salt, arrival_time),
            reserved=reserved,
        )
        return RequestStream(self, request_id, queue)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        **kwargs,
    ) -> AsyncIterator[RequestOutput]:
        """`add` as an async generator: leaving early (disconnect, timeout, cancellation) aborts."""
        stream = self.add(request_id, prompt_token_ids, params, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def _forget(self, request_id: str, abort: bool) -> None:
        self._queues.pop(request_id, None)
        if abort:
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
        if self.error is not None:
            raise EngineDeadError(self.dead_reason or "the engine loop stopped")
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

    def _submit(self, command: tuple, reserved: bool = False) -> None:
        with self._wakeup:
            self._commands.append(command)
            if command[0] == "add":
                num_samples = command[3].n
                self._num_pending_samples += num_samples
                if reserved:
                    self._num_reserved -= num_samples
            self._wakeup.notify()

    def _next_command(self) -> tuple | None:
        with self._wakeup:
            if not self._commands:
                return None
            return self._commands.popleft()

    def _publish_waiting(self, handed_over: int = 0) -> None:
        """After the engine's queue changed: move `handed_over` samples from pending to the engine's count,
        in one locked update so `num_waiting` never sees a sample twice or not at all."""
        with self._wakeup:
            self._num_pending_samples -= handed_over
            self._num_engine_waiting = self.engine.num_waiting_samples

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

    def _add(self, command: tuple) -> None:
        _, request_id, prompt_ids, params, prompt, salt, arrival = command
        try:
            if request_id not in self._queues:
                return  # the caller gave up before the request reached the engine
            faults = self._faults
            if (
                faults is not None
                and faults.engine_seed is not None
                and params.seed == faults.engine_seed
            ):
                self._fault_armed = True
            try:
                self.engine.add_request(
                    request_id, prompt_ids, params, prompt=prompt, cache_salt=salt,
                    arrival_time=arrival,
                )  # fmt: skip
                self._unscheduled[request_id] = command
            except KVServeError as exc:
                self._fail(request_id, exc)
            except Exception as exc:  # attributable: this request alone fails
                logger.exception("adding request %s failed", request_id)
                self._fail(request_id, RequestFailedError(f"internal error: {exc!r}"))
        finally:
            self._publish_waiting(params.n)

    def _fail(self, request_id: str, exc: KVServeError) -> None:
        self.engine.abort_request(request_id)  # whatever it left behind goes back to the pool
        self._unscheduled.pop(request_id, None)
        self._deliver(request_id, exc)

    def _apply_commands(self) -> None:
        while (command := self._next_command()) is not None:
            kind = command[0]
            if kind == "add":
                self._add(command)
            elif kind == "abort":
                self._unscheduled.pop(command[1], None)
                self.engine.abort_request(command[1])
            elif kind == "call":
                command[1](self.engine)
        if self._quarantine and self._probation is None:
            command = self._quarantine.popleft()
            if command[1] in self._queues:  # not given up meanwhile
                self._probation = command[1]
                with self._wakeup:
                    self._num_pending_samples += command[3].n
                self._add(command)

    def _parent_id(self, sample_id: str) -> str | None:
        if sample_id in self._queues or sample_id in self._unscheduled:
            return sample_id
        parent, _, index = sample_id.rpartition("-")
        return parent if index.isdigit() and parent in self._unscheduled else None

    def _step(self) -> list[RequestOutput]:
        """One engine step; a failure charged to the step's newcomers fails them, not the loop."""
        before = self.engine.last_scheduler_output
        try:
            outputs = self.engine.step()
        except Exception as exc:
            scheduled = self.engine.last_scheduler_output
            if scheduled is before or not scheduled.new_requests:
                raise  # the scheduler itself, or only requests that already ran: not attributable
            suspects = list(
                dict.fromkeys(
                    p for new in scheduled.new_requests if (p := self._parent_id(new.request_id))
                )
            )
            if not suspects:
                raise
            self._isolate(suspects, exc)
            self.engine.check_invariants()  # recovery must leave a consistent cache, or the engine dies
            return []
        for new in self.engine.last_scheduler_output.new_requests:
            parent = self._parent_id(new.request_id)
            if parent is not None:
                self._unscheduled.pop(parent, None)
                if parent == self._probation:
                    self._probation = None
        return outputs

    def _isolate(self, suspects: list[str], exc: Exception) -> None:
        if len(suspects) == 1 or self._probation in suspects:
            culprit = suspects[0] if len(suspects) == 1 else self._probation
            logger.error("request %s failed in the engine step: %r", culprit, exc, exc_info=exc)
            self._fail(culprit, RequestFailedError(f"internal error: {exc!r}"))
            innocent = [s for s in suspects if s != culprit]
        else:
            logger.warning("a step failed with %d new requests; retrying them one by one: %r",
                           len(suspects), exc)  # fmt: skip
            innocent = suspects
        self._probation = None
        for (
            request_id
        ) in innocent:  # re-admitted later, one at a time; nothing of theirs was sent yet
            command = self._unscheduled.pop(request_id, None)
            self.engine.abort_request(request_id)
            if command is not None:
                self._quarantine.append(command)
        self._publish_waiting()

    def _run(self) -> None:
        try:
            clock = time.perf_counter
            while True:
                slept_s = 0.0
                with self._wakeup:
                    while (
                        not self._commands
                        and not self._quarantine
                        and not self.engine.has_unfinished_requests()
                    ):
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
                outputs = self._step()
                t2 = clock()
                self._publish_waiting()
                self.stats = self._collect_stats()
                if self._fault_armed:
                    raise RuntimeError("injected engine fault")
                if self._faults is not None and self._faults.step_delay_s and outputs:
                    time.sleep(self._faults.step_delay_s)
                if self.on_step is not None:
                    self.on_step(outputs)
                self._deliver_all([(output.request_id, output) for output in outputs])
                self._log_step(slept_s, t0, t1, t2, clock())
        except BaseException as exc:  # not attributable to a request: fail every request, loudly
            logger.exception("engine loop failed")
            self.dead_reason = f"the engine loop stopped: {exc!r}"
            self.error = exc
            dead = EngineDeadError(self.dead_reason)
            self._deliver_all([(request_id, dead) for request_id in list(self._queues)])
            while (command := self._next_command()) is not None:
                if command[0] == "call":  # maintenance calls waiting for the thread get the error
                    command[1](DeadEngine(EngineDeadError(self.dead_reason)))
            if self.on_dead is not None:
                self.on_dead(self.dead_reason)

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


class RequestStream:
    """The outputs of one submitted request, as an async iterator; `aclose` aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self._open = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            self._open = False
            self._engine._forget(self.request_id, abort=False)
        return item

    def interrupt(self, error: BaseException) -> None:
        """Make the next read raise `error` (after the outputs already queued)."""
        if self._open:
            self._queue.put_nowait(error)

    async def aclose(self) -> None:
        if self._open:
            self._open = False
            self._engine._forget(self.request_id, abort=True)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
