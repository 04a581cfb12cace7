"""The front end's one accumulator of an engine core's per-step deltas.

The core sends only what each step added (kvserve.engine.wire.RequestDelta). Each request is tracked
here once, as one `_Sample` per sample: the token ids and logprobs grow by `extend`, the text as a list
of pieces joined only when someone reads the whole text, the token times as one list. What a step
returns depends on the request's `OutputKind`, chosen by its caller:

- `DELTA` (streams): every step, only what it added (`delta_*`, and `text`/`token_ids`/`logprobs`
  hold the same delta), with the running count `num_tokens`. Nothing of the request's past is copied,
  so a stream of n tokens costs O(n) in total here.
- `FINAL` (non-streaming callers, `LLM.generate`): nothing until the request finishes, then the whole
  request once.
- `CUMULATIVE` (the default of the step-by-step APIs, `LLM.generate_steps`): every step, a frozen
  snapshot of the request so far: its own copies of the lists, so O(length) per step by nature. The
  server and `LLM.generate` never ask for it.

`so_far(tracked)` gives the whole request at any moment (a failed or aborted request's accounting).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.core.outputs import TokenLogprob
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.engine.wire import RequestDelta, SampleDelta


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL = "final"


@dataclass
class _Sample:
    """Everything the front end knows of one sample: the one accumulator of its output."""

    index: int
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    text_pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    token_times: list[float] = field(default_factory=list)
    structured_initial: bool | None = None  # False for a constrained request, until it completes
    last: SampleDelta | None = None  # the latest delta: finish reason, counters, timestamps

    def text(self) -> str:
        if len(self.text_pieces) > 1:
            self.text_pieces[:] = ["".join(self.text_pieces)]
        return self.text_pieces[0] if self.text_pieces else ""


@dataclass
class Tracked:
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    samples: list[_Sample]
    finished: bool = False


class OutputProcessor:
    def __init__(self) -> None:
        self._requests: dict[str, Tracked] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> Tracked:
        with_logprobs = params.logprobs is not None
        samples = [
            _Sample(
                index=index,
                arrival_time=arrival_time,
                logprobs=[] if with_logprobs else None,
                cumulative_logprob=0.0 if with_logprobs else None,
                structured_initial=False if params.structured is not None else None,
            )
            for index in range(params.n)
        ]
        tracked = Tracked(prompt, list(prompt_token_ids), kind, samples)
        self._requests[request_id] = tracked
        return tracked

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, deltas: list[RequestDelta]) -> list[RequestOutput]:
        """Apply a step's deltas; an output for every request they touched, as its kind asks (a
        `FINAL` request only when it finishes). Finished requests are forgotten."""
        outputs = []
        for delta in deltas:
            tracked = self._requests.get(delta.request_id)
            if tracked is None:
                continue  # aborted meanwhile
            for sample_delta in delta.samples:
                _apply(tracked.samples[sample_delta.index], sample_delta)
            if delta.finished:
                tracked.finished = True
                del self._requests[delta.request_id]
            elif tracked.kind is OutputKind.FINAL:
                continue
            changed = {d.index: d for d in delta.samples}
            kind = tracked.kind
            whole, copy = kind is not OutputKind.DELTA, kind is OutputKind.CUMULATIVE
            outputs.append(_output(delta.request_id, tracked, changed, whole, copy))
        return outputs


def so_far(request_id: str, tracked: Tracked) -> RequestOutput:
    """The whole request as accumulated until now (whatever its kind)."""
    return _output(request_id, tracked, {}, whole=True, copy=False)


def _apply(sample: _Sample, delta: SampleDelta) -> None:
    sample.token_ids.extend(delta.new_token_ids)
    if delta.new_text:
        sample.text_pieces.append(delta.new_text)
    if sample.logprobs is not None and delta.new_logprobs:
        sample.logprobs.extend(delta.new_logprobs)
        sample.cumulative_logprob += sum(lp.logprob for lp in delta.new_logprobs)
    sample.token_times.extend(delta.metrics.new_token_times)
    sample.last = delta


def _output(
    request_id: str, tracked: Tracked, changed: dict[int, SampleDelta], whole: bool, copy: bool
) -> RequestOutput:
    """Every sample: whole (its own copies of the lists with `copy`, else the accumulator's), or
    (DELTA) only what this step's delta in `changed` added to it."""
    views = [_view(s, changed.get(s.index), whole, copy) for s in tracked.samples]
    first = views[0]
    return RequestOutput(
        request_id=request_id,
        prompt=tracked.prompt,
        prompt_token_ids=tracked.prompt_token_ids,
        outputs=views,
        finished=tracked.finished,
        num_cached_tokens=first.num_cached_tokens,
        metrics=first.metrics,
    )


def _view(sample: _Sample, step: SampleDelta | None, whole: bool, copy: bool) -> CompletionOutput:
    """One sample for a caller; `step` is what this step added to it (None: nothing)."""
    new_logprobs = list(step.new_logprobs) if step and step.new_logprobs else None
    token_times = list(sample.token_times) if copy else sample.token_times
    if whole:
        text, token_ids, logprobs = sample.text(), sample.token_ids, sample.logprobs
        if copy:
            token_ids = list(token_ids)
            logprobs = None if logprobs is None else list(logprobs)
    else:
        text = step.new_text if step else ""
        token_ids = list(step.new_token_ids) if step else []
        logprobs = None if sample.logprobs is None else (new_logprobs or [])
    last = sample.last
    return CompletionOutput(
        index=sample.index,
        text=text,
        token_ids=token_ids,
        finish_reason=last.finish_reason if last else None,
        logprobs=logprobs,
        cumulative_logprob=sample.cumulative_logprob,
        delta_text=step.new_text if step else "",
        delta_token_ids=list(step.new_token_ids) if step else [],
        delta_logprobs=new_logprobs,
        stop_reason=last.stop_reason if last else None,
        metrics=RequestMetrics(
            arrival_time=sample.arrival_time,
            first_scheduled_time=last.metrics.first_scheduled_time if last else None,
            first_token_time=last.metrics.first_token_time if last else None,
            token_times=token_times,
            finished_time=last.metrics.finished_time if last else None,
            num_preemptions=last.metrics.num_preemptions if last else 0,
        ),
        num_tokens=len(sample.token_ids),
        num_cached_tokens=last.num_cached_tokens if last else 0,
        num_spec_proposed=last.num_spec_proposed if last else 0,
        num_spec_accepted=last.num_spec_accepted if last else 0,
        structured_complete=last.structured_complete if last else sample.structured_initial,
    )
