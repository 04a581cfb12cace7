"""The serving loop: a thread of its own steps one `EngineCore`, fed by commands, read by `emit`.

`ServingLoop(core, emit, faults=...)` takes the core over (its deltas go to `emit` from then on:
the core accumulates nothing) and `start()` runs the loop. Commands (kvserve.engine.wire: add, abort,
utility calls; or a callable `fn(core)`, in-process maintenance) queued by `submit` are applied
between steps; after every step (or batch of commands) `emit` receives a `CoreOutputs`: the step's
`RequestDelta`s, the requests accepted and refused, the stats snapshot, utility results, the step's
timings. The in-process client (kvserve.engine.async_engine) takes them directly; the engine-core
process (kvserve.engine.core_proc) sends them over ZMQ.

What the loop owns, and which thread touches it:

- the command queue (`_commands`, under `_wakeup`): any thread appends (`submit`), the loop thread
  takes; `shutdown` (any thread) sets `_stopping` and wakes it;
- the admissions and answers not yet sent (`_accepted`, `_failures`, `_results`, the count of
  samples taken from the queue), the quarantine and the request on probation, the step gate: the
  loop thread only;
- the adds waiting for their grammar (`_compiling`): the loop thread only; the grammar thread
  (`kvserve-core-grammar`, started by the first such add) takes jobs from `_grammar_jobs`, compiles
  them one at a time through the core's grammar cache, appends to `_compile_times` and hands each
  result back as a command;
- `dead_reason`: written once by the loop thread when it dies, read by any thread.

Failure isolation: an exception while adding one request, or in a step that admitted new requests,
is charged to those requests (a `RequestFailedError` failure, HTTP 500) and the loop goes on; when
several newcomers share the failing step they are re-admitted one at a time until the culprit is
found. Only a failure that no request explains (or a broken cache invariant after recovery) stops the
loop: the core is then dead (`CoreOutputs.dead_reason`).

Grammars: a request whose structured-output grammar the core has not compiled is checked without it,
then waits, outside the scheduler, while the grammar thread compiles it, and is added after without a
second check; the step loop never compiles.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from kvserve.core.errors import KVServeError
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.core import EngineCore
from kvserve.engine.faults import (
    DeadEngine,
    FaultInjection,
    grammar_gate,
    inject_runner_fault,
    step_gate,
)
from kvserve.engine.request_records import ClientRequest, ValidatedRequest
from kvserve.engine.step_log import chunk_row
from kvserve.engine.wire import (
    AbortCmd,
    AddCmd,
    CoreOutputs,
    EngineDeadError,
    Failure,
    RequestDelta,
    RequestFailedError,
    StepRow,
    UtilityCmd,
    UtilityResult,
    failure_of,
)

logger = logging.getLogger("kvserve.engine.core")  # the core's name, as core_proc logs it


def _warm_up(core: EngineCore) -> None:
    """One tiny request through the real path (allocations, first-call overheads)."""
    core.add_request("warmup", [0], SamplingParams(max_tokens=2, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step_deltas()


def _debug_engine(core: EngineCore) -> dict:
    core.check_invariants()
    return {
        "num_free_blocks": core.num_free_blocks(),
        "num_blocks": core.num_blocks,
        "num_requests": core.num_requests,
        "invariants": "ok",
    }


# The utility calls a client may make (`UtilityCmd.method`), each run with the core between steps.
UTILITIES: dict[str, Callable] = {
    "reset_prefix_cache": lambda e: bool(e.kv_manager.pool.reset_prefix_cache()),
    "debug_engine": _debug_engine,
    "warm_up": lambda e: _warm_up(e) is None,
}


class ServingLoop:
    """The loop that serves one `EngineCore`: commands in (`submit`), `CoreOutputs` out (`emit`)."""

    def __init__(
        self,
        core: EngineCore,
        emit: Callable[[CoreOutputs], None],
        *,
        faults: FaultInjection | None = None,
    ) -> None:
        self.core = core
        self.emit = emit
        core.outputs = None  # deltas go to the client, which keeps the one accumulator
        self._commands: deque = deque()  # any thread, under `_wakeup`
        self._wakeup = threading.Condition()
        self._stopping = False
        self.dead_reason: str | None = None
        self._num_admitted = 0  # cumulative samples taken from the queue
        # Accepted requests taken out of a failing step, re-admitted one at a time (`_probation`).
        self._quarantine: deque[ClientRequest] = deque()
        self._probation: ClientRequest | None = None
        self._failures: list[Failure] = []
        self._accepted: list[str] = []  # added since the last message: the client stops waiting
        self._results: list[UtilityResult] = []
        self._faults = faults
        self._fault_armed = False
        if faults is not None and faults.request_seed is not None:
            inject_runner_fault(core.runner, faults.request_seed)
        # tests (--inject-fault gate:WHERE): one `is None` check a step without it
        self._gate = step_gate(faults, self._wakeup, lambda: self._stopping)
        core.gate_grammar_compiles(grammar_gate(faults))
        # Adds checked and waiting for their grammar to compile on `_grammar_thread`.
        self._compiling: dict[str, tuple[AddCmd, ValidatedRequest]] = {}
        self._grammar_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._grammar_thread: threading.Thread | None = None
        self._compile_times: list[float] = []  # appended by the grammar thread
        core.on_grammar_compile = self._compile_times.append
        self._mask_times = core.runner.grammar_mask_times_s
        self._thread: threading.Thread | None = None

    # --- any thread -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def submit(self, command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (if started), then the core's tensor-parallel and grammar compile workers,
        if any (`EngineCore.shutdown`; also done when the core is collected)."""
        self._grammar_jobs.put(None)
        self._stopping = True
        with self._wakeup:
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return  # a step still runs: its workers stay until the process ends
        self.core.shutdown()

    def _next_command(self):
        with self._wakeup:
            return self._commands.popleft() if self._commands else None

    # --- intake (the loop thread) -----------------------------------------------------------------------

    def _intake(self, cmd: AddCmd) -> None:
        """The one check of a request, at add: refused, it fails at once; accepted, it joins the
        scheduler, or first waits for its grammar to compile (`_defer`), not checked again after."""
        core = self.core
        try:
            validated = core.validate(cmd.prompt_token_ids, cmd.params, compile_grammar=False)
        except Exception as exc:
            self._num_admitted += cmd.params.n  # taken from the queue, as `_add` counts it
            self._fail(cmd.request_id, self._request_error(cmd.request_id, exc))
            return
        structured = cmd.params.structured
        if structured is not None and not core.grammar_compiled(structured):
            self._defer(cmd, validated)
        else:
            self._add(cmd, validated)

    def _add(self, cmd: AddCmd, validated: ValidatedRequest) -> None:
        self._num_admitted += cmd.params.n
        faults = self._faults
        if (
            faults is not None
            and faults.engine_seed is not None
            and cmd.params.seed == faults.engine_seed
        ):
            self._fault_armed = True
        try:
            self.core.add_request(
                cmd.request_id,
                validated,
                prompt=cmd.prompt,
                cache_salt=cmd.cache_salt,
                arrival_time=cmd.arrival_time,
                group=cmd.group,
            )
            self._accepted.append(cmd.request_id)
        except Exception as exc:
            self._fail(cmd.request_id, self._request_error(cmd.request_id, exc))

    def _readmit(self, record: ClientRequest) -> None:
        """A quarantined request back into the scheduler, on probation (it was accepted once)."""
        try:
            self.core.add_request(
                record.request_id,
                record.validated,
                prompt=record.prompt,
                cache_salt=record.cache_salt,
                arrival_time=record.arrival_time,
                group=record.group,
            )
        except Exception as exc:
            self._fail(record.request_id, self._request_error(record.request_id, exc))
            return
        self._probation = self.core.record(record.request_id)  # the new record: nothing ran yet

    @staticmethod
    def _request_error(request_id: str, exc: Exception) -> KVServeError:
        """The error a request gets: its own typed error, or an internal error (this request alone
        fails)."""
        if isinstance(exc, KVServeError):
            return exc
        logger.error("adding request %s failed", request_id, exc_info=exc)
        return RequestFailedError(f"internal error: {exc!r}")

    # --- grammars ---------------------------------------------------------------------------------------

    def _defer(self, cmd: AddCmd, validated: ValidatedRequest) -> None:
        """Hand the request's grammar to the grammar thread; `_compiled` adds the request after."""
        logger.info("request %s: compiling a structured-output grammar", cmd.request_id)
        self._compiling[cmd.request_id] = (cmd, validated)
        if self._grammar_thread is None:
            self._grammar_thread = threading.Thread(
                target=self._compile_grammars, name="kvserve-core-grammar", daemon=True
            )
            self._grammar_thread.start()
        self._grammar_jobs.put(cmd)

    def _compile_grammars(self) -> None:
        """The grammar thread: compile each job, then hand its outcome to the loop thread."""
        while (cmd := self._grammar_jobs.get()) is not None:
            error: BaseException | None = None
            try:
                self.core.grammars().compile(cmd.params.structured)
            except Exception as exc:  # the request's own error, given to it in the loop
                error = exc
            self.submit(lambda core, cmd=cmd, error=error: self._compiled(core, cmd, error))

    def _compiled(self, core, cmd: AddCmd, error: BaseException | None) -> None:
        """In the loop thread, once `cmd`'s grammar compiled (or failed to): add it, or fail it."""
        if isinstance(core, DeadEngine):
            return
        waiting = self._compiling.pop(cmd.request_id, None)
        if waiting is None:
            return  # aborted while its grammar compiled
        if error is None:
            self._add(cmd, waiting[1])
            return
        self._num_admitted += cmd.params.n  # taken from the queue, as `_add` counts it
        if not isinstance(error, KVServeError):
            error = RequestFailedError(f"internal error: {error!r}")
        self._fail(cmd.request_id, error)

    # --- commands (the loop thread) ---------------------------------------------------------------------

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.core.abort_request(request_id)  # whatever it left behind goes back to the pool
        self._failures.append(failure_of(request_id, exc))

    def _utility(self, cmd: UtilityCmd) -> None:
        try:
            value = UTILITIES[cmd.method](self.core, *cmd.args)
            self._results.append(UtilityResult(cmd.call_id, value))
        except Exception as exc:
            self._results.append(UtilityResult(cmd.call_id, None, failure_of("", exc)))

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            waiting = self._compiling.pop(request_id, None)
            if waiting is not None:  # it leaves the queue without being added
                self._num_admitted += waiting[0].params.n
            for record in [r for r in self._quarantine if r.request_id == request_id]:
                self._quarantine.remove(record)  # given up before its re-admission
            self.core.abort_request(request_id)

    def _apply_commands(self) -> None:
        while (cmd := self._next_command()) is not None:
            if isinstance(cmd, AddCmd):
                self._intake(cmd)
            elif isinstance(cmd, AbortCmd):
                self._abort(cmd.request_ids)
            elif isinstance(cmd, UtilityCmd):
                self._utility(cmd)
            elif callable(cmd):  # in-process maintenance: fn(core)
                cmd(self.core)
        probation = self._probation
        if probation is not None and self.core.record(probation.request_id) is None:
            self._probation = None  # aborted before it ran a step: the next one may come back
        if self._quarantine and self._probation is None:
            self._readmit(self._quarantine.popleft())

    # --- steps (the loop thread) ------------------------------------------------------------------------

    def _step(self) -> list[RequestDelta]:
        """One engine step; a failure charged to the step's newcomers fails them, not the loop."""
        core = self.core
        before = core.last_scheduler_output
        try:
            deltas = core.step_deltas()
        except Exception as exc:
            scheduled = core.last_scheduler_output
            if scheduled is before or not scheduled.new_requests:
                raise  # the scheduler itself, or only requests that already ran: not attributable
            suspects = core.newcomers(scheduled)
            if not suspects:
                raise
            self._isolate(suspects, exc)
            core.check_invariants()  # recovery must leave a consistent cache, or the core dies
            return []
        probation = self._probation
        if probation is not None and probation.samples[0].first_scheduled_time is not None:
            self._probation = None  # it ran a step without failing
        return deltas

    def _isolate(self, suspects: list[str], exc: Exception) -> None:
        probation_id = None if self._probation is None else self._probation.request_id
        if len(suspects) == 1 or probation_id in suspects:
            culprit = suspects[0] if len(suspects) == 1 else probation_id
            logger.error("request %s failed in the engine step: %r", culprit, exc, exc_info=exc)
            self._fail(culprit, RequestFailedError(f"internal error: {exc!r}"))
            innocent = [s for s in suspects if s != culprit]
        else:
            logger.warning(
                "a step failed with %d new requests; retrying them one by one: %r",
                len(suspects),
                exc,
            )
            innocent = suspects
        self._probation = None
        for request_id in innocent:  # re-admitted later, one at a time; nothing of theirs was sent
            record = self.core.record(request_id)  # a newcomer of the failed step: still held
            self.core.abort_request(request_id)
            self._quarantine.append(record)

    def run(self) -> None:
        """The loop thread: apply commands, step, publish, until stopped with nothing unfinished."""
        core = self.core
        try:
            clock = time.perf_counter
            while True:
                slept_s = 0.0
                with self._wakeup:
                    while (
                        not self._commands
                        and not self._quarantine
                        and not core.has_unfinished_requests()
                    ):
                        if self._stopping:
                            return
                        t_sleep = clock()
                        self._wakeup.wait()
                        slept_s += clock() - t_sleep
                    if self._stopping and not core.has_unfinished_requests():
                        return
                t0 = clock()
                self._apply_commands()
                # the callers waiting on their checks go on now
                if self._accepted or self._failures:
                    self._publish_admissions()
                if self._gate is not None and not self._gate_lets_step_through():
                    continue  # held by the test: a command that arrives is applied meanwhile
                t1 = clock()
                deltas = self._step()
                t2 = clock()
                if self._fault_armed:
                    raise RuntimeError("injected engine fault")
                self._publish(deltas, (slept_s, t0, t1, t2))
                if self._gate is not None and deltas:
                    self._gate.passed()
        except BaseException as exc:  # not attributable to a request: the core is dead, loudly
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        logger.exception("engine loop failed")
        self.dead_reason = f"the engine loop stopped: {exc!r}"
        while (cmd := self._next_command()) is not None:
            if callable(cmd):  # maintenance calls waiting for the thread get the error
                cmd(DeadEngine(EngineDeadError(self.dead_reason)))
            elif isinstance(cmd, UtilityCmd):
                self._results.append(
                    UtilityResult(cmd.call_id, None, Failure("", "dead", self.dead_reason))
                )
        self.emit(CoreOutputs(results=self._take_results(), dead_reason=self.dead_reason))

    def _gate_lets_step_through(self) -> bool:
        """Tests (`--inject-fault gate:WHERE`): wait while the test holds the next step; utility calls
        applied meanwhile are answered at once. False: a command arrived first."""
        if self._results:
            self.emit(CoreOutputs(results=self._take_results()))
        return self._gate.wait(lambda: bool(self._commands), lambda: self.core.num_requests)

    # --- outputs (the loop thread) ----------------------------------------------------------------------

    def _publish_admissions(self) -> None:
        accepted, self._accepted = self._accepted, []
        failures, self._failures = self._failures, []
        self.emit(CoreOutputs(accepted=accepted, failures=failures))

    def _take_results(self) -> list[UtilityResult]:
        results, self._results = self._results, []
        return results

    def _publish(self, deltas, times: tuple[float, float, float, float]) -> None:
        slept_s, t0, t1, t2 = times
        core = self.core
        last = core.last_scheduler_output
        chunks = () if last is None else tuple(map(chunk_row, last.chunks))
        masks = []
        while self._mask_times:
            masks.append(self._mask_times.popleft())
        failures, self._failures = self._failures, []
        accepted, self._accepted = self._accepted, []
        compiles, self._compile_times[:] = list(self._compile_times), []
        # slept: only the time asleep waiting for work (idle), never lock or interpreter waits
        self.emit(
            CoreOutputs(
                accepted=accepted,
                deltas=deltas,
                failures=failures,
                results=self._take_results(),
                stats=core.collect_stats(),
                num_admitted_samples=self._num_admitted,
                num_waiting_samples=core.num_waiting_samples,
                step=StepRow(
                    t0,
                    slept_s,
                    t1 - t0,
                    t2 - t1,
                    time.perf_counter() - t2,
                    chunks,
                    core.runner.last_step_threads,
                ),
                grammar_compile_s=compiles,
                grammar_mask_s=masks,
            )
        )
