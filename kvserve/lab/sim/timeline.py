"""What a simulated run recorded, per request and per run, and its conversion to the bench's raw
records so that every metric (docs/metrics.md) comes from the same code as a load test's."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.groups import KVLayout
from kvserve.lab.bench.records import RequestRecord, StreamEvent
from kvserve.lab.sim.workload import SimRequest

FAKE_TOKEN_ID = 1  # every simulated sampled token; never an end-of-sequence id
EOS_TOKEN_ID = 0


@dataclass
class RequestTimeline:
    """One request's simulated life. Times are seconds on the run clock."""

    request: SimRequest
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    num_preemptions: int = 0
    error: str | None = None  # rejected at validation, as the engine would
    error_kind: str | None = None  # one of REJECTION_KINDS

    def reject(self, rejection: tuple[str, str] | None) -> bool:
        """Record a validation outcome; True when the request is accepted."""
        if rejection is not None:
            self.error_kind, self.error = rejection
        return rejection is None

    @property
    def request_id(self) -> str:
        return request_id(self.request.index)

    def to_record(self) -> RequestRecord:
        """A bench record: sent at arrival, one streamed event per token (with the running token
        count, as a server with per-chunk usage reports it), queue time = first scheduled - arrival."""
        r = self.request
        if self.error is not None:
            return RequestRecord(
                request_id=self.request_id,
                index=r.index,
                phase=r.phase,
                outcome="failed",
                t_scheduled_s=r.arrival_s,
                t_send_s=r.arrival_s,
                t_end_s=r.arrival_s,
                max_tokens=r.num_output_tokens,
                num_prompt_tokens_server=r.num_prompt_tokens,
                http_status=400,
                error=self.error,
            )
        if self.finish_s is None:
            raise ValueError(f"{self.request_id} did not finish")
        events = tuple(StreamEvent(t, 1, k) for k, t in enumerate(self.token_times_s, start=1))
        queue = None
        if self.first_scheduled_s is not None:
            queue = self.first_scheduled_s - r.arrival_s
        return RequestRecord(
            request_id=self.request_id,
            index=r.index,
            phase=r.phase,
            outcome="ok",
            t_scheduled_s=r.arrival_s,
            t_send_s=r.arrival_s,
            t_end_s=self.finish_s,
            max_tokens=r.num_output_tokens,
            events=events,
            num_prompt_tokens_server=r.num_prompt_tokens,
            num_completion_tokens_server=len(self.token_times_s),
            finish_reason="length",
            queue_time_s=queue,
            extra={"num_preemptions": self.num_preemptions} if self.num_preemptions else {},
        )


@dataclass
class SimRun:
    """A whole simulated run of one policy over one list of requests."""

    policy: str
    timelines: list[RequestTimeline]
    num_steps: int = 0
    num_preemptions: int = 0
    busy_s: float = 0.0  # simulated time spent in steps
    end_s: float = 0.0
    peak_kv_usage: float = 0.0
    num_blocks: int = 0

    def records(self) -> list[RequestRecord]:
        return [t.to_record() for t in self.timelines]

    def stats(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "num_requests_preempted": sum(t.num_preemptions > 0 for t in self.timelines),
            "busy_s": self.busy_s,
            "end_s": self.end_s,
            "busy_fraction": self.busy_s / self.end_s if self.end_s > 0 else None,
            "peak_kv_usage": self.peak_kv_usage,
            "num_blocks": self.num_blocks,
            "num_rejected": sum(t.error is not None for t in self.timelines),
            "rejections": self.rejections(),
        }

    def rejections(self) -> dict[str, dict]:
        """Why requests were rejected: kind -> {count, example message, example request}."""
        out: dict[str, dict] = {}
        for t in self.timelines:
            if t.error is None:
                continue
            entry = out.setdefault(
                t.error_kind or "other",
                {"count": 0, "example": t.error, "example_request": t.request_id},
            )
            entry["count"] += 1
        return out


def request_id(index: int) -> str:
    return f"sim-{index}"


def prompt_token_ids(index: int, num_tokens: int) -> tuple[int, ...]:
    """A prompt no other request shares (the first token encodes the index, so every chained block
    hash differs): no accidental prefix-cache hits."""
    return (EOS_TOKEN_ID + 2 + index,) + (FAKE_TOKEN_ID,) * (num_tokens - 1)


def make_request(sim: SimRequest) -> Request:
    """The engine's Request for a simulated one: ignore_eos and max_tokens = its output length, so
    its length is exact."""
    params = SamplingParams(max_tokens=sim.num_output_tokens, ignore_eos=True, temperature=0.0)
    return Request(
        request_id=request_id(sim.index),
        prompt_token_ids=prompt_token_ids(sim.index, sim.num_prompt_tokens),
        sampling_params=params,
        max_tokens=sim.num_output_tokens,
        eos_token_ids=frozenset({EOS_TOKEN_ID}),
    )


# Why the engine's admission checks reject a request (kind -> what it means).
REJECTION_KINDS = {
    "longer_than_context": "prompt + output tokens exceed max_model_len",
    "larger_than_cache": "the request needs more KV blocks than the whole cache holds",
}


def validation_error(
    sim: SimRequest,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    layout: KVLayout | None = None,
    max_chunk: int | None = None,
) -> tuple[str, str] | None:
    """The engine's admission checks (EngineCore.validate): too long for the context, or more KV
    blocks than the whole cache holds (with a hybrid `layout`, its peak over the groups when
    prompt chunks are at most `max_chunk` tokens; block 0 is its null block). (kind, message), or
    None when the request is admitted."""
    total = sim.num_prompt_tokens + sim.num_output_tokens
    if sim.num_prompt_tokens >= max_model_len or total > max_model_len:
        return (
            "longer_than_context",
            f"prompt {sim.num_prompt_tokens} + output {sim.num_output_tokens} = {total} tokens "
            f"exceeds the context of {max_model_len} tokens",
        )
    needed = -(-total // block_size)
    if layout is not None and layout.hybrid:
        needed = layout.max_blocks(total, block_size, max_chunk or total)
        num_blocks -= 1
    if needed > num_blocks:
        return (
            "larger_than_cache",
            f"{total} tokens need {needed} KV blocks; the cache holds {num_blocks}",
        )
    return None
