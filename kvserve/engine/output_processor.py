"""The front end's accumulation of an engine core's per-step deltas into `RequestOutput` snapshots.

The core sends only what each step added (kvserve.engine.wire.RequestDelta); this is the one place that
holds a request's cumulative text, token ids, logprobs and metrics on the client side. A snapshot it
returns is the caller's: the next delta never changes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.engine.wire import RequestDelta, SampleDelta


@dataclass
class _Tracked:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[CompletionOutput]


class OutputProcessor:
    def __init__(self) -> None:
        self._requests: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        samples = [
            CompletionOutput(
                index=index,
                structured_complete=False if params.structured is not None else None,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                metrics=RequestMetrics(arrival_time=arrival_time),
            )
            for index in range(params.n)
        ]
        self._requests[request_id] = _Tracked(prompt, list(prompt_token_ids), samples)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(
        self, deltas: list[RequestDelta], finished_only: bool = False
    ) -> list[RequestOutput]:
        """Apply a step's deltas; a snapshot of every request they touched (finished ones are
        dropped), or with `finished_only` of those that finished (a caller that waits for the end
        skips the per-step copies)."""
        outputs = []
        for delta in deltas:
            tracked = self._requests.get(delta.request_id)
            if tracked is None:
                continue  # aborted meanwhile
            if finished_only and not delta.finished:
                for sample_delta in delta.samples:
                    _apply(tracked.samples[sample_delta.index], sample_delta)
                continue
            changed = {d.index: d for d in delta.samples}
            snapshot = []
            for completion in tracked.samples:
                sample_delta = changed.get(completion.index)
                if sample_delta is not None:
                    _apply(completion, sample_delta)
                snapshot.append(_snapshot(completion, sample_delta))
            first = tracked.samples[0]
            outputs.append(
                RequestOutput(
                    request_id=delta.request_id,
                    prompt=tracked.prompt,
                    prompt_token_ids=tracked.prompt_token_ids,
                    outputs=snapshot,
                    finished=delta.finished,
                    num_cached_tokens=first.num_cached_tokens,
                    metrics=snapshot[0].metrics,
                )
            )
            if delta.finished:
                del self._requests[delta.request_id]
        return outputs


def _apply(completion: CompletionOutput, delta: SampleDelta) -> None:
    completion.token_ids.extend(delta.new_token_ids)
    completion.text += delta.new_text
    if completion.logprobs is not None and delta.new_logprobs:
        completion.logprobs.extend(delta.new_logprobs)
        completion.cumulative_logprob += sum(lp.logprob for lp in delta.new_logprobs)
    if delta.finish_reason is not None:
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = delta.stop_reason
    completion.num_cached_tokens = delta.num_cached_tokens
    completion.num_spec_proposed = delta.num_spec_proposed
    completion.num_spec_accepted = delta.num_spec_accepted
    if delta.structured_complete is not None:
        completion.structured_complete = delta.structured_complete
    m, f = completion.metrics, delta.metrics
    m.token_times.extend(f.new_token_times)  # the tracked list; every snapshot copies it
    completion.metrics = RequestMetrics(
        arrival_time=m.arrival_time,
        first_scheduled_time=f.first_scheduled_time,
        first_token_time=f.first_token_time,
        token_times=m.token_times,
        finished_time=f.finished_time,
        num_preemptions=f.num_preemptions,
    )


def _snapshot(c: CompletionOutput, delta: SampleDelta | None) -> CompletionOutput:
    m = c.metrics
    return CompletionOutput(
        index=c.index,
        text=c.text,
        token_ids=list(c.token_ids),
        finish_reason=c.finish_reason,
        logprobs=None if c.logprobs is None else list(c.logprobs),
        cumulative_logprob=c.cumulative_logprob,
        delta_text=delta.new_text if delta else "",
        delta_token_ids=list(delta.new_token_ids) if delta else [],
        delta_logprobs=list(delta.new_logprobs) if delta and delta.new_logprobs else None,
        stop_reason=c.stop_reason,
        metrics=RequestMetrics(
            arrival_time=m.arrival_time,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time,
            token_times=list(m.token_times),
            finished_time=m.finished_time,
            num_preemptions=m.num_preemptions,
        ),
        num_cached_tokens=c.num_cached_tokens,
        num_spec_proposed=c.num_spec_proposed,
        num_spec_accepted=c.num_spec_accepted,
        structured_complete=c.structured_complete,
    )
