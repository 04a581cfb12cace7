"""The engine core loop: commands in, per-step deltas out (docs/engine_core.md).

`EngineCore` owns an `LLMEngine` (scheduler, KV manager, runner) and runs its step loop in one thread.
Commands (kvserve.engine.wire: add, abort, utility calls) are queued by `submit` and applied between steps;
after every step (or batch of commands) `emit` receives a `CoreOutputs`: the step's `RequestDelta`s, the
requests that failed, the stats snapshot, utility results, the step's timings. The in-process client calls
`emit`'s results directly; the engine-core process (kvserve.engine.core_proc) sends them over ZMQ.

Failure isolation: an exception while adding one request, or in a step that admitted new requests, is
charged to those requests (a `RequestFailedError` failure, HTTP 500) and the loop goes on; when several
newcomers share the failing step they are re-admitted one at a time until the culprit is found. Only a
failure that no request explains (or a broken cache invariant after recovery) stops the loop: the core is
then dead (`CoreOutputs.dead_reason`).

Grammars: a request whose structured-output grammar this engine has not compiled waits, outside the
scheduler, while a thread of its own compiles it (one at a time), and is added after; the step loop never
compiles. With data parallelism the front checks a request (compiling its grammar) on one core and may
route it to another, which compiled it again inside its step loop: every stream on that core stalled for
the compile, seconds for a large schema.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from kvserve.core.errors import KVServeError
from kvserve.engine.faults import (
    DeadEngine,
    FaultInjection,
    grammar_gate,
    inject_runner_fault,
    step_gate,
)
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.step_log import chunk_row
from kvserve.engine.wire import (
    AbortCmd,
    AddCmd,
    CoreOutputs,
    EngineDeadError,
    EngineInfo,
    EngineStats,
    Failure,
    RequestFailedError,
    StepRow,
    UtilityCmd,
    UtilityResult,
    failure_of,
)
from kvserve.model.kernel_choice import served_kernels
from kvserve.quant.describe import describe_weights
from kvserve.threads import describe_threads

logger = logging.getLogger(__name__)


def engine_info(engine: LLMEngine) -> EngineInfo:
    c = engine.config
    spec = c.speculative
    speculative = (
        "off"
        if spec is None
        else f"{spec.method}"
        + (f" ({spec.draft_model_dir})" if spec.draft_model_dir else "")
        + f", {spec.num_speculative_tokens} tokens per step"
    )
    tok = engine.tokenizer
    return EngineInfo(
        model_dir=str(c.model_dir),
        model_type=c.model.model_type,
        dtype=str(c.dtype),
        device=str(c.device),
        quantization=getattr(c, "quantization", None),
        vocab_size=c.model.vocab_size,
        num_layers=c.model.num_layers,
        max_model_len=engine.max_model_len,
        num_blocks=engine.num_blocks,
        block_size=c.cache.block_size,
        kv_bytes_per_token=int(c.model.kv_bytes_per_token(c.dtype)),
        max_num_seqs=c.scheduler.max_num_seqs,
        max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        enable_prefix_caching=c.cache.enable_prefix_caching,
        admission=str(c.scheduler.admission),
        speculative=speculative,
        tokenizer=None if tok is None else str(getattr(tok, "name_or_path", "") or c.model_dir),
        eos_token_ids=tuple(engine.eos_token_ids),
        threads=describe_threads(torch.get_num_threads()),
        grammar_compile_timeout_s=c.grammar_compile_timeout_s,
        weights=describe_weights(
            str(c.dtype), c.quantization, c.quantization_method, c.model_dir, c.gguf_activations
        ),
        kv_cache_sizing=c.cache.sizing,
        kv_cache_bytes=int(engine.runner.kv_cache_bytes),
        kv_groups=describe_groups(engine.kv_manager.layout),
        blocks_per_full_seq=engine.kv_manager.num_blocks_for(
            engine.max_model_len, c.scheduler.max_num_batched_tokens
        ),
        **served_kernels(c.model_dir, c.weight_scheme),
    )


def describe_groups(layout) -> str:
    """One line on a hybrid layout's KV groups, "" for one table."""
    if not layout.hybrid:
        return ""
    full = sum(g.window is None for g in layout.groups)
    windows = sorted({g.window for g in layout.groups if g.window is not None})
    return (
        f"hybrid: {full} global + {len(layout.groups) - full} sliding-window group(s) (window "
        f"{', '.join(map(str, windows))}) of {layout.group_size} layers; window groups return "
        "blocks their window has left"
    )


def _warm_up(engine: LLMEngine) -> None:
    """One tiny request through the real path (allocations, first-call overheads)."""
    from kvserve.core.sampling_params import SamplingParams

    engine.add_request("warmup", [0], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step_deltas()


def _debug_engine(engine: LLMEngine) -> dict:
    engine.check_invariants()
    return {
        "num_free_blocks": engine.num_free_blocks(),
        "num_blocks": engine.num_blocks,
        "num_requests": engine.num_requests,
        "invariants": "ok",
    }


UTILITIES: dict[str, Callable] = {
    "reset_prefix_cache": lambda e: bool(e.kv_manager.pool.reset_prefix_cache()),
    "debug_engine": _debug_engine,
    "warm_up": lambda e: _warm_up(e) is None,
}


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        emit: Callable[[CoreOutputs], None],
        *,
        faults: FaultInjection | None = None,
    ) -> None:
        self.engine = engine
        engine.outputs = None  # deltas go to the client; nothing accumulates here
        self.emit = emit
        self._commands: deque = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self.dead_reason: str | None = None
        self._num_admitted = 0  # cumulative samples taken from the queue
        # Adds not yet scheduled, kept so that a failing step's newcomers can be re-admitted one at a time.
        self._unscheduled: dict[str, AddCmd] = {}
        self._live: set[str] = set()  # requests added and not aborted or finished
        self._quarantine: deque[AddCmd] = deque()
        self._probation: str | None = None
        self._failures: list[Failure] = []
        self._accepted: list[str] = []  # added since the last message: the client stops waiting
        self._results: list[UtilityResult] = []
        self._faults = faults
        self._fault_armed = False
        if faults is not None and faults.request_seed is not None:
            inject_runner_fault(engine.runner, faults.request_seed)
        # tests (--inject-fault gate:WHERE, grammar-gate:WHERE): None, one `is None` check a step
        self._gate = step_gate(faults, self._wakeup, lambda: self._stopping)
        engine.gate_grammar_compiles(grammar_gate(faults))
        # Adds waiting for their grammar to compile on `_grammar_thread` (touched by the loop thread only).
        self._compiling: dict[str, AddCmd] = {}
        self._grammar_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._grammar_thread: threading.Thread | None = None
        self._compile_times: list[float] = []
        engine.on_grammar_compile = self._compile_times.append
        self._mask_times = engine.runner.grammar_mask_times_s
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def submit(self, command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._grammar_jobs.put(None)
        self._stopping = True
        with self._wakeup:
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # --- the loop ---------------------------------------------------------------------------------------

    def _next_command(self):
        with self._wakeup:
            return self._commands.popleft() if self._commands else None

    def _add(self, cmd: AddCmd, count: bool = True) -> None:
        if count:
            self._num_admitted += cmd.params.n
        faults = self._faults
        if (
            faults is not None
            and faults.engine_seed is not None
            and cmd.params.seed == faults.engine_seed
        ):
            self._fault_armed = True
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt_token_ids,
                cmd.params,
                prompt=cmd.prompt,
                cache_salt=cmd.cache_salt,
                arrival_time=cmd.arrival_time,
                group=cmd.group,
            )
            self._unscheduled[cmd.request_id] = cmd
            self._live.add(cmd.request_id)
            if count:  # a re-admission from quarantine was accepted the first time
                self._accepted.append(cmd.request_id)
        except KVServeError as exc:
            self._fail(cmd.request_id, exc)
        except Exception as exc:  # attributable: this request alone fails
            logger.exception("adding request %s failed", cmd.request_id)
            self._fail(cmd.request_id, RequestFailedError(f"internal error: {exc!r}"))

    def _needs_compile(self, cmd: AddCmd) -> bool:
        structured = cmd.params.structured
        return structured is not None and not self.engine.grammar_compiled(structured)

    def _refused_before_compile(self, cmd: AddCmd) -> KVServeError | None:
        """The checks that need no grammar (context, capacity, sampling) first: a request that fails
        them does not wait for a compile only to be refused."""
        try:
            self.engine.validate(cmd.prompt_token_ids, cmd.params.without_structured())
        except KVServeError as exc:
            self._num_admitted += cmd.params.n  # taken from the queue, as `_add` counts it
            self._fail(cmd.request_id, exc)
            return exc
        return None

    def _defer(self, cmd: AddCmd) -> None:
        """Hand the request's grammar to the grammar thread; `_compiled` adds the request after."""
        logger.info("request %s: compiling a structured-output grammar", cmd.request_id)
        self._compiling[cmd.request_id] = cmd
        if self._grammar_thread is None:
            self._grammar_thread = threading.Thread(
                target=self._compile_grammars, name="kvserve-core-grammar", daemon=True
            )
            self._grammar_thread.start()
        self._grammar_jobs.put(cmd)

    def _compile_grammars(self) -> None:
        while (cmd := self._grammar_jobs.get()) is not None:
            error: BaseException | None = None
            try:
                self.engine.grammars().compile(cmd.params.structured)
            except Exception as exc:  # the request's own error, given to it in the loop
                error = exc
            self.submit(lambda engine, cmd=cmd, error=error: self._compiled(engine, cmd, error))

    def _compiled(self, engine, cmd: AddCmd, error: BaseException | None) -> None:
        """In the loop thread, once `cmd`'s grammar compiled (or failed to): add it, or fail it."""
        if isinstance(engine, DeadEngine) or self._compiling.pop(cmd.request_id, None) is None:
            return  # aborted while its grammar compiled
        if error is None:
            self._add(cmd)
            return
        self._num_admitted += cmd.params.n  # taken from the queue, as `_add` counts it
        if not isinstance(error, KVServeError):
            error = RequestFailedError(f"internal error: {error!r}")
        self._fail(cmd.request_id, error)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.engine.abort_request(request_id)  # whatever it left behind goes back to the pool
        self._unscheduled.pop(request_id, None)
        self._live.discard(request_id)
        self._failures.append(failure_of(request_id, exc))

    def _utility(self, cmd: UtilityCmd) -> None:
        try:
            value = UTILITIES[cmd.method](self.engine, *cmd.args)
            self._results.append(UtilityResult(cmd.call_id, value))
        except Exception as exc:
            self._results.append(UtilityResult(cmd.call_id, None, failure_of("", exc)))

    def _apply_commands(self) -> None:
        while (cmd := self._next_command()) is not None:
            if isinstance(cmd, AddCmd):
                if not self._needs_compile(cmd):
                    self._add(cmd)
                elif self._refused_before_compile(cmd) is None:
                    self._defer(cmd)
            elif isinstance(cmd, AbortCmd):
                for request_id in cmd.request_ids:
                    waiting = self._compiling.pop(request_id, None)
                    if waiting is not None:  # it leaves the queue without being added
                        self._num_admitted += waiting.params.n
                    self._unscheduled.pop(request_id, None)
                    self._live.discard(request_id)
                    self.engine.abort_request(request_id)
            elif isinstance(cmd, UtilityCmd):
                self._utility(cmd)
            elif callable(cmd):  # in-process maintenance: fn(engine)
                cmd(self.engine)
        if self._quarantine and self._probation is None:
            cmd = self._quarantine.popleft()
            if cmd.request_id in self._live:  # not given up meanwhile
                self._probation = cmd.request_id
                self._add(cmd, count=False)

    def _parent_id(self, sample_id: str) -> str | None:
        if sample_id in self._unscheduled:
            return sample_id
        parent, _, index = sample_id.rpartition("-")
        return parent if index.isdigit() and parent in self._unscheduled else None

    def _step(self):
        """One engine step; a failure charged to the step's newcomers fails them, not the loop."""
        before = self.engine.last_scheduler_output
        try:
            deltas = self.engine.step_deltas()
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
            self.engine.check_invariants()  # recovery must leave a consistent cache, or the core dies
            return []
        for new in self.engine.last_scheduler_output.new_requests:
            parent = self._parent_id(new.request_id)
            if parent is not None:
                self._unscheduled.pop(parent, None)
                if parent == self._probation:
                    self._probation = None
        for delta in deltas:
            if delta.finished:
                self._live.discard(delta.request_id)
        return deltas

    def _isolate(self, suspects: list[str], exc: Exception) -> None:
        if len(suspects) == 1 or self._probation in suspects:
            culprit = suspects[0] if len(suspects) == 1 else self._probation
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
        for (
            request_id
        ) in innocent:  # re-admitted later, one at a time; nothing of theirs was sent yet
            cmd = self._unscheduled.pop(request_id, None)
            self.engine.abort_request(request_id)
            if cmd is not None:
                self._quarantine.append(cmd)

    def run(self) -> None:
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
                if (
                    self._accepted or self._failures
                ):  # the callers waiting on their checks go on now
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
        return self._gate.wait(lambda: bool(self._commands), lambda: self.engine.num_requests)

    def _publish_admissions(self) -> None:
        accepted, self._accepted = self._accepted, []
        failures, self._failures = self._failures, []
        self.emit(CoreOutputs(accepted=accepted, failures=failures))

    def _take_results(self) -> list[UtilityResult]:
        results, self._results = self._results, []
        return results

    def _publish(self, deltas, times: tuple[float, float, float, float]) -> None:
        slept_s, t0, t1, t2 = times
        last = self.engine.last_scheduler_output
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
                stats=self.collect_stats(),
                num_admitted_samples=self._num_admitted,
                num_waiting_samples=self.engine.num_waiting_samples,
                step=StepRow(
                    t0,
                    slept_s,
                    t1 - t0,
                    t2 - t1,
                    time.perf_counter() - t2,
                    chunks,
                    self.engine.runner.last_step_threads,
                ),
                grammar_compile_s=compiles,
                grammar_mask_s=masks,
            )
        )

    def collect_stats(self) -> EngineStats:
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
            num_threads=engine.runner.num_threads,
            num_thread_changes=engine.runner.num_thread_changes,
            cpu_lost=engine.runner.cpu_lost,
            kv_group_kinds=tuple(g.name for g in kv.groups),
            kv_group_blocks=tuple(kv.blocks_in_use()),
        )
