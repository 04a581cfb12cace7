"""One engine core per process: it owns its requests, from the check at add to the last delta.

`EngineCore` holds the scheduler, the KV manager, the model runner and the core's record of every request
it accepted (kvserve.engine.request_records): docs/design.md, docs/engine_core.md. A request is checked
once, when it is added (`validate`); a refused one raises. Each step (`step_deltas`) schedules, runs the
model and lets the scheduler decide every stop (the core's detokenizers answer its stop-string check),
then returns what the step added to each request that changed (`RequestDelta`s). Every time is read from
one injected clock.

It is driven in one of two ways:

- directly (the offline `LLM`, tests, calibration): `add_request`, then `step()` (the outputs each
  request's `output_kind` asks for, accumulated by `self.outputs`) or `step_deltas()`;
- by a serving loop (kvserve.engine.serving_loop.ServingLoop), one thread of its own that applies
  commands between steps and ships each step's deltas to a client; the loop owns the commands, the
  quarantine after a failing step and the grammar compiles it waits for.

Added directly, a request's grammar compiles in `validate`; the serving loop compiles it on a thread of
its own first (`validate(..., compile_grammar=False)`, then `grammars().compile`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from kvserve.config import EngineConfig
from kvserve.core.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
)
from kvserve.core.outputs import ScheduledChunk, SchedulerOutput, StopStringMatch
from kvserve.core.request import Request, RequestStatus, sample_request_id
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.faults import FaultInjection, step_gate
from kvserve.engine.output_processor import OutputKind, OutputProcessor
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.request_records import ClientRequest, SampleOutput, ValidatedRequest
from kvserve.engine.wire import EngineStats, RequestDelta
from kvserve.kv.manager import KVCacheManager
from kvserve.runner.executor import make_runner
from kvserve.sched.scheduler import Scheduler
from kvserve.tokenizer import load_tokenizer, stop_token_ids

_score_ids = itertools.count()


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
        # `step()` accumulates deltas here for callers that drive the core directly; a serving loop
        # sets it to None: it ships `step_deltas()` to its client, which keeps the one accumulator.
        self.outputs: OutputProcessor | None = OutputProcessor()
        # tests (`gate_steps`): the gate each offline `step` passes first; `shutdown` opens it
        self._gate = None
        self._gate_wakeup = threading.Condition()
        self._shut_down = False

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

    def record(self, request_id: str) -> ClientRequest | None:
        """The record of a request this core holds (None once it finished or was aborted)."""
        return self._requests.get(request_id)

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
        first passes the test's step gate, as a serving loop's steps do. Returns once the test has
        told the gate its state: a run started right after cannot step past a gate the test holds
        from the start."""
        self._gate = step_gate(faults, self._gate_wakeup, lambda: self._shut_down)
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

    def newcomers(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The requests whose first sample `scheduler_output` admitted (the siblings of n > 1 follow
        sample 0 later): the suspects when that step fails."""
        return [
            s.client_request.request_id
            for new in scheduler_output.new_requests
            if (s := self._samples.get(new.request_id)) is not None
            and s is s.client_request.samples[0]
        ]

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

    def shutdown(self) -> None:
        """Stop the tensor-parallel and grammar compile workers, if any (also done when the core is
        collected), and open the offline step gate. A serving loop calls it once its thread ended."""
        with self._gate_wakeup:
            self._shut_down = True
            self._gate_wakeup.notify()
        self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.close()

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
