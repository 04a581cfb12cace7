"""What the engine returns to its users (the offline API, the async front end)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.outputs import TokenLogprob


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timestamps on the engine's clock (seconds), as of the output that carries them. Its
    `token_times` is the request's own list (kvserve.engine.output_processor): it grows until the request
    finishes."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample of a request. `delta_*` are what the last step added; `text`/`token_ids`/`logprobs` are
    the whole sample so far, or for a stream (OutputKind.DELTA) the same delta. `num_tokens` counts the
    tokens generated so far either way."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    metrics: RequestMetrics | None = None
    num_tokens: int = 0
    num_cached_tokens: int = 0
    num_spec_proposed: int = 0  # speculative proposals verified for this sample
    num_spec_accepted: int = 0
    # Constrained requests: True once the grammar accepted a complete document; a request that ends for
    # another reason (length, a stop string) may hold an incomplete one. None when unconstrained.
    structured_complete: bool | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache (of the first sample)
    metrics: RequestMetrics
