"""The engine core loop: schedule -> execute -> update, plus request intake and text output.

`LLMEngine` is synchronous and single-threaded; the offline `LLM` API and the async front end both drive it.
A request with n > 1 samples fans out into n scheduler requests (`{id}-{i}`); samples 1..n-1 are admitted once
sample 0 has computed the prompt and share its full prompt blocks by reference (with or without prefix caching).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.core.errors import CapacityError, ContextLengthError, InvalidRequestError
from kvserve.core.outputs import RequestUpdate, ScheduledChunk
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import load_tokenizer, stop_token_ids
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.kv.manager import KVCacheManager
from kvserve.runner.model_runner import ModelRunner
from kvserve.sched.scheduler import Scheduler

_score_ids = itertools.count()


@dataclass
class _Sample:
    request_id: str  # the scheduler's id
    parent: _Parent
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    cache_salt: str | None
    arrival_time: float
    samples: list[_Sample] = field(default_factory=list)
    # One list shared by every snapshot: the prompt never changes, so a step's host work does not grow
    # with its length.
    prompt_token_list: list[int] = field(default_factory=list)
    pending: list[Request] = field(default_factory=list)  # samples waiting for sample 0's prefill

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.completion.finished for s in self.samples)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, tokenizer=None, load_default_tokenizer: bool = True
    ) -> None:
        self.config = config
        if tokenizer is None and load_default_tokenizer:
            tokenizer = load_tokenizer(config.model_dir)
        self.tokenizer = tokenizer
        self.eos_token_ids = stop_token_ids(config.model_dir, config.model, tokenizer)
        self.num_blocks = config.num_blocks
        self.kv_manager = KVCacheManager(
            self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.runner = ModelRunner(config, self.num_blocks)
        self._samples: dict[str, _Sample] = {}
        self._parents: dict[str, _Parent] = {}
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self.on_grammar_compile = None  # callback(seconds), e.g. a metrics histogram
        self.last_scheduler_output = None  # the latest step's decision (calibration, debugging)

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
                )
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
        self, prompt_token_ids: list[int] | tuple[int, ...], params: SamplingParams
    ) -> int:
        """Check a request against the model and the cache; returns its resolved max_tokens."""
        self._validate_token_ids(prompt_token_ids)
        num_prompt = len(prompt_token_ids)
        vocab = self.config.model.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(
                f"logit_bias names token ids >= vocab size {vocab}", "logit_bias"
            )
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
        needed = self.kv_manager.num_blocks_for(num_prompt + max_tokens + lookahead)
        if needed > self.num_blocks:
            raise CapacityError(
                f"prompt + max_tokens = {num_prompt + max_tokens} tokens (+ {lookahead} lookahead) need "
                f"{needed} KV blocks; the cache has {self.num_blocks} blocks of "
                f"{self.config.cache.block_size} tokens",
                "max_tokens",
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int] | tuple[int, ...],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self._parents:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        max_tokens = self.validate(prompt_token_ids, params)
        parent = _Parent(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            cache_salt=cache_salt,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            prompt_token_list=list(prompt_token_ids),
        )
        requests = []
        for index in range(params.n):
            sample_params = params
            if params.n > 1 and params.seed is not None:
                sample_params = params.with_updates(seed=params.seed + index)
            sample_id = request_id if params.n == 1 else f"{request_id}-{index}"
            request = Request(
                request_id=sample_id,
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=sample_params,
                max_tokens=max_tokens,
                arrival_time=parent.arrival_time,
                eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt,
            )
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, parent.prompt_token_ids, params
                )
            completion = CompletionOutput(
                index=index,
                structured_complete=False if params.structured is not None else None,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                metrics=RequestMetrics(arrival_time=parent.arrival_time),
            )
            sample = _Sample(sample_id, parent, completion, detokenizer)
            parent.samples.append(sample)
            self._samples[sample_id] = sample
            requests.append(request)
        self._parents[request_id] = parent
        # Samples 1..n-1 wait for sample 0 to compute the prompt, then share its full prompt blocks.
        self.scheduler.add_request(requests[0])
        for request in requests[1:]:
            request.prompt_source_id = requests[0].request_id
        parent.pending = requests[1:]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (all its samples) now; its blocks return to the pool."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        parent.pending.clear()
        sample_ids = [s.request_id for s in parent.samples]
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        now = time.monotonic()
        for sample in parent.samples:
            self._samples.pop(sample.request_id, None)
            completion = sample.completion
            if not completion.finished:
                completion.finish_reason = "abort"
                completion.metrics.finished_time = now
        return self._snapshot(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_requests(self) -> int:
        return len(self._parents)

    @property
    def num_waiting_samples(self) -> int:
        """Samples not yet admitted: the scheduler's waiting queue plus n > 1 samples held back."""
        return self.scheduler.num_waiting + sum(len(p.pending) for p in self._parents.values())

    # --- the loop ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns a snapshot of every request that changed."""
        scheduler_output = self.scheduler.schedule(now=time.monotonic())
        self.last_scheduler_output = scheduler_output
        now = time.monotonic()
        for new in scheduler_output.new_requests:
            self._samples[new.request_id].completion.metrics.first_scheduled_time = now
        for request_id in scheduler_output.preempted_request_ids:
            self._samples[request_id].completion.metrics.num_preemptions += 1
        if scheduler_output.empty and not scheduler_output.finished_request_ids:
            return []
        runner_output = self.runner.execute(scheduler_output)
        updates = self.scheduler.update(scheduler_output, runner_output)
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        for update in updates:
            sample = self._samples.get(update.request_id)
            if sample is None:
                continue
            self._apply(sample, update, now)
            touched[sample.parent.request_id] = sample.parent
        outputs = []
        for parent in touched.values():
            if parent.pending and parent.samples[0].completion.token_ids:
                for request in parent.pending:  # sample 0 has computed the prompt now
                    self.scheduler.add_request(request)
                parent.pending = []
            outputs.append(self._snapshot(parent))
            if parent.finished:
                del self._parents[parent.request_id]
                for sample in parent.samples:
                    self._samples.pop(sample.request_id, None)
        return outputs

    def _apply(self, sample: _Sample, update: RequestUpdate, now: float) -> None:
        completion = sample.completion
        metrics = completion.metrics
        completion.num_cached_tokens = update.num_cached_tokens
        completion.num_spec_proposed += update.num_spec_proposed
        completion.num_spec_accepted += update.num_spec_accepted
        if update.grammar_complete:
            completion.structured_complete = True
        new_ids = list(update.new_token_ids)
        completion.token_ids.extend(new_ids)
        completion.delta_token_ids = new_ids
        if new_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.extend([now] * len(new_ids))
        completion.delta_logprobs = list(update.new_logprobs) if update.new_logprobs else None
        if completion.logprobs is not None and update.new_logprobs:
            completion.logprobs.extend(update.new_logprobs)
            completion.cumulative_logprob += sum(lp.logprob for lp in update.new_logprobs)
        finish_reason = update.finish_reason
        if finish_reason == "stop" and new_ids:
            last = new_ids[-1]
            if last in sample.parent.params.stop_token_ids or last in self.eos_token_ids:
                completion.stop_reason = last
        delta = ""
        if sample.detokenizer is not None:
            detok = sample.detokenizer
            delta = detok.update(new_ids, finished=finish_reason is not None)
            if detok.stopped and finish_reason is None:
                # A stop string ended it: the scheduler still thinks it is running.
                self.scheduler.finish_requests([sample.request_id], RequestStatus.FINISHED_STOPPED)
                finish_reason = "stop"
                completion.stop_reason = detok.stop_string
        completion.text += delta
        completion.delta_text = delta
        if finish_reason is not None:
            completion.finish_reason = finish_reason
            metrics.finished_time = now

    def _snapshot(self, parent: _Parent) -> RequestOutput:
        first = parent.samples[0].completion
        outputs = [_copy_completion(s.completion) for s in parent.samples]
        for sample in parent.samples:  # a delta is reported once
            sample.completion.delta_text = ""
            sample.completion.delta_token_ids = []
            sample.completion.delta_logprobs = None
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_list,
            outputs=outputs,
            finished=parent.finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=first.metrics,
        )

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
            arrival_time=time.monotonic(),
        )
        if not self.kv_manager.allocate_slots(request, len(token_ids)):
            raise CapacityError(
                f"{len(token_ids)} tokens do not fit the free KV cache now", "prompt"
            )
        try:
            block_ids = tuple(self.kv_manager.block_ids(request.request_id))
            step = chunk_size or len(token_ids)
            parts = []
            for start in range(0, len(token_ids), step):
                chunk = ScheduledChunk(
                    request.request_id, token_ids[start : start + step], start, block_ids, False, 0
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


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    # Snapshots must not change under the caller when the engine steps again.
    return CompletionOutput(
        index=c.index,
        text=c.text,
        token_ids=list(c.token_ids),
        finish_reason=c.finish_reason,
        logprobs=None if c.logprobs is None else list(c.logprobs),
        cumulative_logprob=c.cumulative_logprob,
        delta_text=c.delta_text,
        delta_token_ids=list(c.delta_token_ids),
        delta_logprobs=c.delta_logprobs,
        stop_reason=c.stop_reason,
        metrics=c.metrics,
        num_cached_tokens=max(c.num_cached_tokens, 0),
        num_spec_proposed=c.num_spec_proposed,
        num_spec_accepted=c.num_spec_accepted,
        structured_complete=c.structured_complete,
    )
