"""A request as the scheduler sees it: token ids and progress, no text."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The scheduler's id of sample `index` of a request with `n` samples: the request's own id when
    n == 1, else `{request_id}-{index}`."""
    return request_id if n == 1 else f"{request_id}-{index}"


@dataclass(eq=False)
class Request:
    """One sequence in the engine. Owned by the scheduler once added.

    Prefill and decode are one thing: `num_computed_tokens` catches up with `num_tokens`. A prefix-cache hit
    starts it above zero; preemption by recompute resets it to zero (emitted tokens are kept).
    A request with `sampling_params.n > 1` is fanned out by the scheduler into n samples (`samples`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, prompt + max_tokens <= max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # the one copy of the output tokens
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit (tokens) at first admission; 0 before it
    first_scheduled_time: float | None = (
        None  # the caller's clock at the first schedule() admitting it
    )
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify in the next step
    # A sibling sample of the same prompt whose full prompt blocks this request may share (n > 1).
    prompt_source_id: str | None = None
    # The client request it belongs to (the server's id: all prompts and samples of one API call);
    # the scheduler admits the least-served group first (docs/scheduling.md "Fairness"). None: FCFS.
    group: str | None = None

    def samples(self) -> list[Request]:
        """The n samples of this request: itself when n == 1; else n new requests with the ids of
        `sample_request_id`, seeds `seed + i` (when seeded), and samples 1..n-1 naming sample 0 as
        their prompt source."""
        params = self.sampling_params
        if params.n == 1:
            return [self]
        out = []
        for index in range(params.n):
            sample_params = params
            if params.seed is not None:
                sample_params = params.with_seed(params.seed + index)
            out.append(
                Request(
                    request_id=sample_request_id(self.request_id, index, params.n),
                    prompt_token_ids=self.prompt_token_ids,
                    sampling_params=sample_params,
                    max_tokens=self.max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    cache_salt=self.cache_salt,
                    prompt_source_id=out[0].request_id if out else None,
                    group=self.group,
                )
            )
        return out

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the longest output it may produce: what `reserve` admission charges."""
        return len(self.prompt_token_ids) + self.max_tokens

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """All token ids (prompt then output) in [start, end)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return tuple(self.output_token_ids[start - num_prompt : end - num_prompt])
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[: end - num_prompt])

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)
