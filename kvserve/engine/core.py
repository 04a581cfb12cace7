"""One engine core per process: it owns its requests, from the check at add to the last delta.

`EngineCore` holds the scheduler, the KV manager, the model runner and the core's record of every request
it accepted (kvserve.engine.request_records): docs/design.md, docs/engine_core.md. A request is checked
once, when it is added (`validate`); a refused one comes back as a failure. Each step (`step_deltas`)
schedules, runs the model and lets the scheduler decide every stop (the core's detokenizers answer its
stop-string check), then returns what the step added to each request that changed (`RequestDelta`s).
Every time is read from one injected clock.

It is driven in one of two ways:

- directly (the offline `LLM`, tests, calibration): `add_request`, then `step()` (the outputs each
  request's `output_kind` asks for, accumulated by `self.outputs`) or `step_deltas()`;
- as a loop (`start(emit)`), one thread: commands (kvserve.engine.wire: add, abort, utility calls) queued
  by `submit` are applied between steps; after every step (or batch of commands) `emit` receives a
  `CoreOutputs`: the step's `RequestDelta`s, the requests accepted and refused, the stats snapshot,
  utility results, the step's timings. The in-process client (kvserve.engine.async_engine) takes them
  directly; the engine-core process (kvserve.engine.core_proc) sends them over ZMQ.

Failure isolation (the loop): an exception while adding one request, or in a step that admitted new
requests, is charged to those requests (a `RequestFailedError` failure, HTTP 500) and the loop goes on;
when several newcomers share the failing step they are re-admitted one at a time until the culprit is
found. Only a failure that no request explains (or a broken cache invariant after recovery) stops the
loop: the core is then dead (`CoreOutputs.dead_reason`).

Grammars (the loop): a request whose structured-output grammar this engine has not compiled is checked
without it, then waits, outside the scheduler, while a thread of its own compiles it (one at a time), and
is added after without a second check; the step loop never compiles. Added directly, a request's grammar
compiles in `validate`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from kvserve.config import EngineConfig
from kvserve.core.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    KVServeError,
)
from kvserve.core.outputs import ScheduledChunk, StopStringMatch
from kvserve.core.request import Request, RequestStatus, sample_request_id
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.faults import (
    DeadEngine,
    FaultInjection,
    grammar_gate,
    inject_runner_fault,
    step_gate,
)
from kvserve.engine.output_processor import OutputKind, OutputProcessor
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.request_records import ClientRequest, SampleOutput, ValidatedRequest
from kvserve.engine.step_log import chunk_row
from kvserve.engine.wire import (
    AbortCmd,
    AddCmd,
    CoreOutputs,
    EngineDeadError,
    EngineStats,
    Failure,
    RequestDelta,
    RequestFailedError,
    StepRow,
    UtilityCmd,
    UtilityResult,
    failure_of,
)
from kvserve.kv.manager import KVCacheManager
from kvserve.runner.executor import make_runner
from kvserve.sched.scheduler import Scheduler
from kvserve.tokenizer import load_tokenizer, stop_token_ids

logger = logging.getLogger(__name__)
_score_ids = itertools.count()


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


UTILITIES: dict[str, Callable] = {
    "reset_prefix_cache": lambda e: bool(e.kv_manager.pool.reset_prefix_cache()),
    "debug_engine": _debug_engine,
    "warm_up": lambda e: _warm_up(e) is None,
}


class EngineCore:
    """The engine core: scheduler, KV manager, runner, and the one record of each request it owns."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer=None,
        load_default_tokenizer: bool = True,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock  # seconds; every timestamp of a request is read from it
        if tokenizer is None and load_default_tokenizer:
            tokenizer = load_tokenizer(config.model_dir)
        self.tokenizer = tokenizer
        self.eos_token_ids = stop_token_ids(config.model_dir, config.model, tokenizer)
        self.kv_manager = KVCacheManager(
            config.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            config.kv_layout,
        )
        # blocks requests can hold: the runner's tensors have one more under a hybrid layout, its
        # null block (kv/groups.py)
        self.num_blocks = self.kv_manager.num_blocks
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.runner = make_runner(config, config.num_blocks)  # rank 0 of N when tensor-parallel
        self._requests: dict[str, ClientRequest] = {}  # by the client's id
        self._samples: dict[str, SampleOutput] = {}  # by the scheduler's id
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self.on_grammar_compile = None  # callback(seconds), e.g. a metrics histogram
        # tests: a gate passed before every grammar compile (engine/faults.py)
        self.grammar_gate = None
        self.last_scheduler_output = None  # the latest step's decision (calibration, debugging)
        # `step()` accumulates deltas here for callers that drive the core directly; `start` sets it to
        # None: the loop ships `step_deltas()` to its client, which keeps the one accumulator.
        self.outputs: OutputProcessor | None = OutputProcessor()
        # --- the loop (`start`); touched by the loop thread only unless said otherwise
        self.emit: Callable[[CoreOutputs], None] | None = None
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
        self._faults: FaultInjection | None = None
        self._fault_armed = False
        # tests (--inject-fault gate:WHERE): one `is None` check a step without it
        self._gate = None
        # Adds checked and waiting for their grammar to compile on `_grammar_thread`.
        self._compiling: dict[str, tuple[AddCmd, ValidatedRequest]] = {}
        self._grammar_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._grammar_thread: threading.Thread | None = None
        self._compile_times: list[float] = []
        self._mask_times = self.runner.grammar_mask_times_s
        self._thread: threading.Thread | None = None

    # --- grammars ---------------------------------------------------------------------------------------

    def grammar_compiled(self, structured) -> bool:
        """Whether `structured` has compiled already (checking it again is a lookup)."""
        grammars = self._grammars
        return grammars is not None and grammars.is_compiled(structured)

    def gate_grammar_compiles(self, gate) -> None:
        """Tests (`--inject-fault grammar-gate:WHERE`): every grammar compile from now on first passes
        `gate` (a kvserve.engine.faults.Gate; None: no gate)."""
        self.grammar_gate = gate
        if self._grammars is not None:
            self._grammars.gate = gate

    def grammars(self):
        """The grammar compiler cache, built on first use (xgrammar indexes the whole vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        "structured output needs the model's tokenizer; this model has none",
                        "response_format",
                    )
                from kvserve.structured.grammar import GrammarCache

                self._grammars = GrammarCache(
                    self.tokenizer,
                    self.config.model.vocab_size,
                    self.eos_token_ids,
                    on_compile=lambda s: self.on_grammar_compile and self.on_grammar_compile(s),
                    compile_timeout_s=self.config.grammar_compile_timeout_s,
                )
                self._grammars.gate = self.grammar_gate
                self.runner.grammars = self._grammars
            return self._grammars

    # --- intake -----------------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def _validate_token_ids(self, token_ids: list[int] | tuple[int, ...]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", "prompt")
        vocab = self.config.model.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt contains token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                "prompt",
            )

    def validate(
        self,
        prompt_token_ids: list[int] | tuple[int, ...],
        params: SamplingParams,
        *,
        compile_grammar: bool = True,
    ) -> ValidatedRequest:
        """Check a request against the model and the cache, once: `add_request` takes the result as
        is. Its grammar, if any, compiles here unless `compile_grammar` is false (the loop compiles it
        on its grammar thread after this check)."""
        self._validate_token_ids(prompt_token_ids)
        num_prompt = len(prompt_token_ids)
        params.check_vocabulary(self.config.model.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", "stop")
        if params.structured is not None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured output needs the model's tokenizer; this model has none",
                    "response_format",
                )
            if compile_grammar:
                self.grammars().compile(params.structured)  # an invalid one fails here, not later
        limit = self.max_model_len
        if num_prompt >= limit:
            raise ContextLengthError(
                f"the prompt has {num_prompt} tokens; this model's context is {limit} tokens, "
                f"which leaves no room for output",
                "prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ContextLengthError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"exceeds this model's context of {limit} tokens",
                "max_tokens",
            )
        # Alone in the cache it must fit whole, with the speculative proposer's lookahead slots.
        lookahead = self.config.scheduler.num_lookahead_tokens if params.speculate else 0
        needed = self.kv_manager.num_blocks_for(
            num_prompt + max_tokens + lookahead, self.config.scheduler.max_num_batched_tokens
        )
        if needed > self.num_blocks:
            raise CapacityError(
                f"prompt + max_tokens = {num_prompt + max_tokens} tokens (+ {lookahead} lookahead) need "
                f"{needed} KV blocks; the cache has {self.num_blocks} blocks of "
                f"{self.config.cache.block_size} tokens",
                "max_tokens",
            )
        return ValidatedRequest(tuple(prompt_token_ids), params, max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: ValidatedRequest | list[int] | tuple[int, ...],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        group: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """Queue a request: a `ValidatedRequest` from `validate` (not checked again), or token ids and
        `params` (validated here). `prompt` is its text, if any (reported back, never tokenised).
        `group`: the client request it is part of, for fair admission (`Request.group`).
        `output_kind`: what `step` returns for it (kvserve.engine.output_processor)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        if isinstance(prompt_token_ids, ValidatedRequest):
            validated = prompt_token_ids
            if params is not None and params != validated.params:
                raise InvalidRequestError(
                    "params differ from the ones the request was validated with", "params"
                )
        else:
            validated = self.validate(prompt_token_ids, params)
        params = validated.params
        record = ClientRequest(
            request_id=request_id,
            validated=validated,
            prompt=prompt,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            group=group,
            prompt_token_list=list(validated.prompt_token_ids),
        )
        for index in range(params.n):  # the scheduler fans the request out under these ids
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, validated.prompt_token_ids, params
                )
            completion = CompletionOutput(
                index=index,
                structured_complete=False if params.structured is not None else None,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            sample_id = sample_request_id(request_id, index, params.n)
            record.samples.append(SampleOutput(sample_id, record, completion, detokenizer))
        if self.outputs is not None:
            self.outputs.add(
                request_id,
                prompt,
                record.prompt_token_list,
                params,
                record.arrival_time,
                output_kind,
            )
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=validated.prompt_token_ids,
                sampling_params=params,
                max_tokens=validated.max_tokens,
                eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt,
                group=group,
            )
        )
        self._requests[request_id] = record
        for sample in record.samples:
            self._samples[sample.request_id] = sample

    def abort_request(self, request_id: str) -> None:
        """End a request (all its samples) now; its blocks return to the pool. Nothing is emitted: the
        caller that aborts it has stopped listening."""
        if self.outputs is not None:
            self.outputs.remove(request_id)
        record = self._requests.pop(request_id, None)
        if record is None:
            return
        sample_ids = [s.request_id for s in record.samples]
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        for sample in record.samples:
            self._samples.pop(sample.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_waiting_samples(self) -> int:
        """Samples not yet admitted (the scheduler's count, n > 1 samples held back included)."""
        return self.scheduler.num_waiting

    # --- one step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of the requests that changed, each as its
        `output_kind` asks (accumulated from the step's deltas by `self.outputs`)."""
        gate = self._gate
        if gate is None:
            return self.outputs.process(self.step_deltas())
        gate.wait(num_requests=lambda: self.num_requests)
        deltas = self.step_deltas()
        if deltas:
            gate.passed()
        return self.outputs.process(deltas)

    def gate_steps(self, faults: FaultInjection | None) -> None:
        """Tests (`kvserve generate --inject-fault gate:WHERE`): every offline `step` from now on
        first passes the test's step gate, as the loop's steps do (`start`). Returns once the test
        has told the gate its state: a run started right after cannot step past a gate the test
        holds from the start."""
        self._gate = step_gate(faults, self._wakeup, lambda: self._stopping)
        if self._gate is not None:
            self._gate.wait_for_the_test()

    def step_deltas(self) -> list[RequestDelta]:
        """Run one scheduling step; returns what it added to every request that changed."""
        now = self.clock()  # one reading: the scheduler's first-scheduled stamp and the metrics'
        scheduler_output = self.scheduler.schedule(now=now)
        self.last_scheduler_output = scheduler_output
        for new in scheduler_output.new_requests:
            self._samples[new.request_id].first_scheduled_time = now
        for request_id in scheduler_output.preempted_request_ids:
            self._samples[request_id].num_preemptions += 1
        if scheduler_output.empty and not (
            scheduler_output.finished_request_ids or scheduler_output.preempted_request_ids
        ):
            return []  # the runner hears of every end and preemption (its tables and draft cache)
        runner_output = self.runner.execute(scheduler_output)
        updates = self.scheduler.update(scheduler_output, runner_output, self._detokenize)
        now = self.clock()
        touched: dict[str, tuple[ClientRequest, list[SampleOutput]]] = {}
        for update in updates:
            sample = self._samples.get(update.request_id)
            if sample is None:
                continue
            sample.apply(update, now)
            record = sample.client_request
            touched.setdefault(record.request_id, (record, []))[1].append(sample)
        deltas = []
        for record, samples in touched.values():
            deltas.append(record.delta(samples))
            if record.finished:
                del self._requests[record.request_id]
                for sample in record.samples:
                    self._samples.pop(sample.request_id, None)
        return deltas

    def _detokenize(
        self, sample_id: str, new_token_ids: tuple[int, ...], finishing: bool
    ) -> StopStringMatch | None:
        """The scheduler's `StopCheck`: the sample's detokenizer consumes the tokens the scheduler
        commits (`finishing`: a token rule ends it with them, so the held-back text is released) and
        says where a stop string ended, if one did. The text waits in the sample's delta; the
        decision is the scheduler's."""
        sample = self._samples.get(sample_id)
        if sample is None or sample.detokenizer is None:
            return None
        detok = sample.detokenizer
        stopped_before = detok.stopped
        sample.completion.delta_text = detok.update(new_token_ids, finished=finishing)
        if detok.stopped and not stopped_before:
            return StopStringMatch(detok.num_used, detok.stop_string)
        return None

    # --- scoring ----------------------------------------------------------------------------------------

    def score(self, token_ids: list[int] | tuple[int, ...], chunk_size: int | None = None):
        """Logits [len(token_ids), vocab] at every position, computed through the paged cache in chunks of
        `chunk_size` tokens (None: one chunk). Runs between steps; the blocks are freed afterwards."""
        import torch

        token_ids = tuple(token_ids)
        # Scoring generates nothing, so the whole context is usable (no room kept for an output).
        self._validate_token_ids(token_ids)
        if len(token_ids) > self.max_model_len:
            raise ContextLengthError(
                f"{len(token_ids)} tokens exceed this model's context of {self.max_model_len} tokens",
                "prompt",
            )
        request = Request(
            request_id=f"score-{next(_score_ids)}",
            prompt_token_ids=token_ids,
            sampling_params=SamplingParams(max_tokens=1),
            max_tokens=1,
        )
        if not self.kv_manager.allocate_slots(request, len(token_ids)):
            raise CapacityError(
                f"{len(token_ids)} tokens do not fit the free KV cache now", "prompt"
            )
        try:
            block_ids, *group_ids = map(tuple, self.kv_manager.group_block_ids(request.request_id))
            step = chunk_size or len(token_ids)
            parts = []
            for start in range(0, len(token_ids), step):
                chunk = ScheduledChunk(  # block_offset 0: the tables whole
                    request.request_id,
                    token_ids[start : start + step],
                    start,
                    block_ids,
                    False,
                    0,
                    group_new_block_ids=tuple(group_ids),
                )
                parts.append(self.runner.score((chunk,)))
            return torch.cat(parts)
        finally:
            self.kv_manager.free(request)

    # --- introspection ----------------------------------------------------------------------------------

    def kv_usage(self) -> float:
        return self.kv_manager.usage

    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    def check_invariants(self) -> None:
        self.kv_manager.check_invariants()

    # --- the loop ---------------------------------------------------------------------------------------

    def start(
        self, emit: Callable[[CoreOutputs], None], *, faults: FaultInjection | None = None
    ) -> None:
        """Run the step loop in a thread of its own: commands from `submit`, outputs to `emit`. Deltas
        go to the client from then on; nothing accumulates here."""
        self.emit = emit
        self.outputs = None
        self._faults = faults
        if faults is not None and faults.request_seed is not None:
            inject_runner_fault(self.runner, faults.request_seed)
        self._gate = step_gate(faults, self._wakeup, lambda: self._stopping)
        self.gate_grammar_compiles(grammar_gate(faults))
        self.on_grammar_compile = self._compile_times.append
        self._thread = threading.Thread(target=self.run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def submit(self, command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (if started), then the tensor-parallel and grammar compile workers, if any
        (also done when the core is collected)."""
        self._grammar_jobs.put(None)
        self._stopping = True
        with self._wakeup:
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return  # a step still runs: its workers stay until the process ends
        self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.close()

    def _next_command(self):
        with self._wakeup:
            return self._commands.popleft() if self._commands else None

    def _intake(self, cmd: AddCmd) -> None:
        """The one check of a request, at add: refused, it fails at once; accepted, it joins the
        scheduler, or first waits for its grammar to compile (`_defer`), not checked again after."""
        try:
            validated = self.validate(cmd.prompt_token_ids, cmd.params, compile_grammar=False)
        except Exception as exc:
            self._num_admitted += cmd.params.n  # taken from the queue, as `_add` counts it
            self._fail(cmd.request_id, self._request_error(cmd.request_id, exc))
            return
        structured = cmd.params.structured
        if structured is not None and not self.grammar_compiled(structured):
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
            self.add_request(
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
            self.add_request(
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
        self._probation = self._requests[record.request_id]  # the new record: nothing ran yet

    @staticmethod
    def _request_error(request_id: str, exc: Exception) -> KVServeError:
        """The error a request gets: its own typed error, or an internal error (this request alone
        fails)."""
        if isinstance(exc, KVServeError):
            return exc
        logger.error("adding request %s failed", request_id, exc_info=exc)
        return RequestFailedError(f"internal error: {exc!r}")

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
        while (cmd := self._grammar_jobs.get()) is not None:
            error: BaseException | None = None
            try:
                self.grammars().compile(cmd.params.structured)
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

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.abort_request(request_id)  # whatever it left behind goes back to the pool
        self._failures.append(failure_of(request_id, exc))

    def _utility(self, cmd: UtilityCmd) -> None:
        try:
            value = UTILITIES[cmd.method](self, *cmd.args)
            self._results.append(UtilityResult(cmd.call_id, value))
        except Exception as exc:
            self._results.append(UtilityResult(cmd.call_id, None, failure_of("", exc)))

    def _apply_commands(self) -> None:
        while (cmd := self._next_command()) is not None:
            if isinstance(cmd, AddCmd):
                self._intake(cmd)
            elif isinstance(cmd, AbortCmd):
                for request_id in cmd.request_ids:
                    waiting = self._compiling.pop(request_id, None)
                    if waiting is not None:  # it leaves the queue without being added
                        self._num_admitted += waiting[0].params.n
                    for record in [r for r in self._quarantine if r.request_id == request_id]:
                        self._quarantine.remove(record)  # given up before its re-admission
                    self.abort_request(request_id)
            elif isinstance(cmd, UtilityCmd):
                self._utility(cmd)
            elif callable(cmd):  # in-process maintenance: fn(core)
                cmd(self)
        if self._probation is not None and self._probation.request_id not in self._requests:
            self._probation = None  # aborted before it ran a step: the next one may come back
        if self._quarantine and self._probation is None:
            self._readmit(self._quarantine.popleft())

    def _step(self):
        """One engine step; a failure charged to the step's newcomers fails them, not the loop."""
        before = self.last_scheduler_output
        try:
            deltas = self.step_deltas()
        except Exception as exc:
            scheduled = self.last_scheduler_output
            if scheduled is before or not scheduled.new_requests:
                raise  # the scheduler itself, or only requests that already ran: not attributable
            # Requests whose first sample this step admitted (siblings follow sample 0 later).
            suspects = [
                s.client_request.request_id
                for new in scheduled.new_requests
                if (s := self._samples.get(new.request_id)) is not None
                and s is s.client_request.samples[0]
            ]
            if not suspects:
                raise
            self._isolate(suspects, exc)
            self.check_invariants()  # recovery must leave a consistent cache, or the core dies
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
            record = self._requests[request_id]
            self.abort_request(request_id)
            self._quarantine.append(record)

    def run(self) -> None:
        try:
            clock = time.perf_counter
            while True:
                slept_s = 0.0
                with self._wakeup:
                    while (
                        not self._commands
                        and not self._quarantine
                        and not self.has_unfinished_requests()
                    ):
                        if self._stopping:
                            return
                        t_sleep = clock()
                        self._wakeup.wait()
                        slept_s += clock() - t_sleep
                    if self._stopping and not self.has_unfinished_requests():
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
        return self._gate.wait(lambda: bool(self._commands), lambda: self.num_requests)

    def _publish_admissions(self) -> None:
        accepted, self._accepted = self._accepted, []
        failures, self._failures = self._failures, []
        self.emit(CoreOutputs(accepted=accepted, failures=failures))

    def _take_results(self) -> list[UtilityResult]:
        results, self._results = self._results, []
        return results

    def _publish(self, deltas, times: tuple[float, float, float, float]) -> None:
        slept_s, t0, t1, t2 = times
        last = self.last_scheduler_output
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
                num_waiting_samples=self.num_waiting_samples,
                step=StepRow(
                    t0,
                    slept_s,
                    t1 - t0,
                    t2 - t1,
                    time.perf_counter() - t2,
                    chunks,
                    self.runner.last_step_threads,
                ),
                grammar_compile_s=compiles,
                grammar_mask_s=masks,
            )
        )

    def collect_stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = self.kv_manager
        spec = self.runner.spec_stats
        return EngineStats(
            spec_num_verify_steps=spec.num_verify_steps,
            spec_num_proposed=spec.num_proposed,
            spec_num_accepted=spec.num_accepted,
            spec_num_emitted=spec.num_emitted,
            spec_draft_time_s=spec.draft_time_s,
            spec_target_time_s=spec.target_time_s,
            num_running=scheduler.num_running,
            num_waiting=self.num_waiting_samples,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            num_preemptions=scheduler.stats.num_preemptions,
            prefix_cache_queries=kv.stats.num_queries,
            prefix_cache_hits=kv.stats.num_hits,
            num_steps=scheduler.stats.num_steps,
            num_threads=self.runner.num_threads,
            num_thread_changes=self.runner.num_thread_changes,
            cpu_lost=self.runner.cpu_lost,
            kv_group_kinds=tuple(g.name for g in kv.groups),
            kv_group_blocks=tuple(kv.blocks_in_use()),
        )
