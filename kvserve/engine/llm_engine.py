"""The engine core loop: schedule -> execute -> update, plus request intake and text output.

`LLMEngine` is synchronous and single-threaded; the offline `LLM` API and the async front end both drive it.
A request is validated once, at intake (`validate` -> `ValidatedRequest`, which `add_request` accepts as is).
The scheduler owns request state: it fans a request with n > 1 samples out into n sequences (`{id}-{i}`),
decides stops and their reason; the engine keeps only what it reports (text, timings) and stamps every
time with one injected clock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.core.errors import CapacityError, ContextLengthError, InvalidRequestError
from kvserve.core.outputs import RequestUpdate, ScheduledChunk
from kvserve.core.request import Request, RequestStatus, sample_request_id
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.output_processor import OutputKind, OutputProcessor
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.wire import FrozenMetrics, RequestDelta, SampleDelta
from kvserve.kv.manager import KVCacheManager
from kvserve.runner.executor import make_runner
from kvserve.sched.scheduler import Scheduler
from kvserve.tokenizer import load_tokenizer, stop_token_ids

_score_ids = itertools.count()


@dataclass(frozen=True)
class ValidatedRequest:
    """A prompt and its sampling parameters, checked against this engine's model and cache by
    `LLMEngine.validate`; `add_request` takes it without checking again."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int  # resolved: never None


@dataclass
class _Sample:
    """The engine's record of one sample: what it reports (the completion, its timings). Progress,
    stops and token ids belong to the scheduler; the times are the engine clock's."""

    request_id: str  # the scheduler's id
    parent: _Parent
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    new_token_times: tuple[float, ...] = ()  # this step's tokens' times, reported once
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    samples: list[_Sample] = field(default_factory=list)
    # One list shared by every snapshot: the prompt never changes, so a step's host work does not grow
    # with its length.
    prompt_token_list: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.completion.finished for s in self.samples)


class LLMEngine:
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
        self._samples: dict[str, _Sample] = {}
        self._parents: dict[str, _Parent] = {}
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self.on_grammar_compile = None  # callback(seconds), e.g. a metrics histogram
        self.grammar_gate = (
            None  # tests: a gate passed before every grammar compile (engine/faults.py)
        )
        self.last_scheduler_output = None  # the latest step's decision (calibration, debugging)
        # `step()` accumulates deltas here for callers that drive the engine directly; an engine core
        # (kvserve.engine.core) sets it to None and ships `step_deltas()` to its client instead.
        self.outputs: OutputProcessor | None = OutputProcessor()

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

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and grammar compile workers, if any (also done when the
        engine is collected)."""
        self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.close()

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
        self, prompt_token_ids: list[int] | tuple[int, ...], params: SamplingParams
    ) -> ValidatedRequest:
        """Check a request against the model and the cache (compiling its grammar, if any), once:
        `add_request` takes the result as is."""
        self._validate_token_ids(prompt_token_ids)
        num_prompt = len(prompt_token_ids)
        params.check_vocabulary(self.config.model.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", "stop")
        if params.structured is not None:
            self.grammars().compile(
                params.structured
            )  # an invalid constraint fails here, not later
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
        if request_id in self._parents:
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
        parent = _Parent(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=validated.prompt_token_ids,
            params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            prompt_token_list=list(validated.prompt_token_ids),
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=validated.prompt_token_ids,
            sampling_params=params,
            max_tokens=validated.max_tokens,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            group=group,
        )
        for index in range(params.n):  # the scheduler fans the request out under these ids
            sample_id = sample_request_id(request_id, index, params.n)
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
            parent.samples.append(_Sample(sample_id, parent, completion, detokenizer))
        if self.outputs is not None:
            self.outputs.add(
                request_id,
                prompt,
                parent.prompt_token_list,
                params,
                parent.arrival_time,
                output_kind,
            )
        self.scheduler.add_request(request)
        self._parents[request_id] = parent
        for sample in parent.samples:
            self._samples[sample.request_id] = sample

    def abort_request(self, request_id: str) -> None:
        """End a request (all its samples) now; its blocks return to the pool. Nothing is emitted: the
        caller that aborts it has stopped listening."""
        if self.outputs is not None:
            self.outputs.remove(request_id)
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        sample_ids = [s.request_id for s in parent.samples]
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        for sample in parent.samples:
            self._samples.pop(sample.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_requests(self) -> int:
        return len(self._parents)

    @property
    def num_waiting_samples(self) -> int:
        """Samples not yet admitted (the scheduler's count, n > 1 samples held back included)."""
        return self.scheduler.num_waiting

    # --- the loop ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of the requests that changed, each as its
        `output_kind` asks (accumulated from the step's deltas by `self.outputs`)."""
        return self.outputs.process(self.step_deltas())

    def step_deltas(self) -> list[RequestDelta]:
        """Run one scheduling step; returns what it added to every request that changed."""
        now = self.clock()  # one reading: the scheduler's first-scheduled stamp and the metrics'
        scheduler_output = self.scheduler.schedule(now=now)
        self.last_scheduler_output = scheduler_output
        for new in scheduler_output.new_requests:
            self._samples[new.request_id].first_scheduled_time = now
        for request_id in scheduler_output.preempted_request_ids:
            self._samples[request_id].num_preemptions += 1
        if scheduler_output.empty and not scheduler_output.finished_request_ids:
            return []
        runner_output = self.runner.execute(scheduler_output)
        updates = self.scheduler.update(scheduler_output, runner_output)
        now = self.clock()
        touched: dict[str, tuple[_Parent, list[_Sample]]] = {}
        for update in updates:
            sample = self._samples.get(update.request_id)
            if sample is None:
                continue
            self._apply(sample, update, now)
            touched.setdefault(sample.parent.request_id, (sample.parent, []))[1].append(sample)
        outputs = []
        for parent, samples in touched.values():
            outputs.append(self._delta(parent, samples))
            if parent.finished:
                del self._parents[parent.request_id]
                for sample in parent.samples:
                    self._samples.pop(sample.request_id, None)
        return outputs

    def _apply(self, sample: _Sample, update: RequestUpdate, now: float) -> None:
        completion = sample.completion
        completion.num_cached_tokens = update.num_cached_tokens
        completion.num_spec_proposed += update.num_spec_proposed
        completion.num_spec_accepted += update.num_spec_accepted
        if update.grammar_complete:
            completion.structured_complete = True
        new_ids = list(update.new_token_ids)
        logprobs = list(update.new_logprobs) if update.new_logprobs else None
        finish_reason = update.finish_reason  # the scheduler's decision, and its reason
        if finish_reason == "stop":
            completion.stop_reason = update.stop_reason
        delta = ""
        if sample.detokenizer is not None:
            detok = sample.detokenizer
            stopped_before = detok.stopped
            delta = detok.update(new_ids, finished=finish_reason is not None)
            if detok.stopped and not stopped_before:
                # A stop string (text, the front end's to match) ended it: tell the scheduler, and
                # keep the tokens up to the one that completed it (a speculative step commits
                # several). It wins over the scheduler's reason in the same step (completed by the
                # max_tokens-th token, the request stopped; it did not reach its length).
                if finish_reason is None:
                    self.scheduler.finish_requests(
                        [sample.request_id], RequestStatus.FINISHED_STOPPED
                    )
                finish_reason = "stop"
                completion.stop_reason = detok.stop_string
                del new_ids[detok.num_used :]
                if logprobs is not None:
                    del logprobs[detok.num_used :]
        completion.delta_token_ids = new_ids
        completion.delta_logprobs = logprobs
        if new_ids and sample.first_token_time is None:
            sample.first_token_time = now
        sample.new_token_times = (now,) * len(new_ids)
        completion.delta_text = delta
        if finish_reason is not None:
            completion.finish_reason = finish_reason
            sample.finished_time = now

    def _delta(self, parent: _Parent, samples: list[_Sample]) -> RequestDelta:
        deltas = []
        for sample in samples:
            c = sample.completion
            deltas.append(
                SampleDelta(
                    index=c.index,
                    new_token_ids=tuple(c.delta_token_ids),
                    new_logprobs=tuple(c.delta_logprobs) if c.delta_logprobs else None,
                    new_text=c.delta_text,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    num_cached_tokens=c.num_cached_tokens,
                    num_spec_proposed=c.num_spec_proposed,
                    num_spec_accepted=c.num_spec_accepted,
                    structured_complete=c.structured_complete,
                    metrics=FrozenMetrics(
                        parent.arrival_time,
                        sample.first_scheduled_time,
                        sample.first_token_time,
                        sample.finished_time,
                        sample.num_preemptions,
                        sample.new_token_times,
                    ),
                )
            )
            c.delta_text, c.delta_token_ids, c.delta_logprobs = "", [], None  # reported once
            sample.new_token_times = ()
        return RequestDelta(parent.request_id, tuple(deltas), parent.finished)

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
                chunk = ScheduledChunk(
                    request.request_id,
                    token_ids[start : start + step],
                    start,
                    block_ids,
                    False,
                    0,
                    group_block_ids=tuple(group_ids),
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
