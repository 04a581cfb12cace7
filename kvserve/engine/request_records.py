"""The engine core's record of each request it owns: what it reports (text, timings), never progress.

Progress, token ids and stops belong to the scheduler's `Request` (kvserve.core.request); a record keeps
what the core reports about a request and its samples, and what re-admitting it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.outputs import RequestUpdate
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.wire import FrozenMetrics, RequestDelta, SampleDelta


@dataclass(frozen=True)
class ValidatedRequest:
    """A prompt and its sampling parameters, checked against this engine's model and cache by
    `EngineCore.validate`; `add_request` takes it without checking again."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int  # resolved: never None


@dataclass
class SampleOutput:
    """What the core reports about one sample of a request: its completion so far, its detokenizer and
    its timings (the engine clock's). Progress, stops and token ids belong to the scheduler."""

    request_id: str  # the scheduler's id (`sample_request_id`)
    client_request: ClientRequest
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    new_token_times: tuple[float, ...] = ()  # this step's tokens' times, reported once
    finished_time: float | None = None
    num_preemptions: int = 0

    def apply(self, update: RequestUpdate, now: float) -> None:
        """Record what the scheduler decided for this sample this step (its text is already in
        `completion.delta_text`: the detokenizer ran inside the scheduler's update)."""
        completion = self.completion
        completion.num_cached_tokens = update.num_cached_tokens
        completion.num_spec_proposed += update.num_spec_proposed
        completion.num_spec_accepted += update.num_spec_accepted
        if update.grammar_complete:
            completion.structured_complete = True
        completion.delta_token_ids = list(update.new_token_ids)
        completion.delta_logprobs = list(update.new_logprobs) if update.new_logprobs else None
        if update.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.new_token_times = (now,) * len(update.new_token_ids)
        if update.finish_reason is not None:
            completion.finish_reason = update.finish_reason
            completion.stop_reason = update.stop_reason
            self.finished_time = now

    def take_delta(self) -> SampleDelta:
        """This step's part of the sample, reported once (the delta fields are cleared)."""
        c = self.completion
        delta = SampleDelta(
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
                self.client_request.arrival_time,
                self.first_scheduled_time,
                self.first_token_time,
                self.finished_time,
                self.num_preemptions,
                self.new_token_times,
            ),
        )
        c.delta_text, c.delta_token_ids, c.delta_logprobs = "", [], None
        self.new_token_times = ()
        return delta


@dataclass
class ClientRequest:
    """A request as a client added it: its checked prompt and parameters, its arrival, and the n
    samples the scheduler runs for it (`{id}-{i}` when n > 1)."""

    request_id: str
    validated: ValidatedRequest
    prompt: str | None
    arrival_time: float
    cache_salt: str | None = None
    group: str | None = None
    samples: list[SampleOutput] = field(default_factory=list)
    # One list shared by every snapshot: the prompt never changes, so a step's host work does not grow
    # with its length.
    prompt_token_list: list[int] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return self.validated.params

    @property
    def finished(self) -> bool:
        return all(s.completion.finished for s in self.samples)

    @property
    def scheduled(self) -> bool:
        """Whether the scheduler has admitted any of its samples yet."""
        return any(s.first_scheduled_time is not None for s in self.samples)

    def delta(self, samples: list[SampleOutput]) -> RequestDelta:
        """What this step added to `samples` (the ones that changed), reported once."""
        deltas = tuple(sample.take_delta() for sample in samples)
        return RequestDelta(self.request_id, deltas, self.finished)
