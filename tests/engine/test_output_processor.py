"""kvserve/engine/output_processor.py: the client's one accumulator of the core's per-step deltas.

A stream (OutputKind.DELTA) must cost O(n) in total over n tokens: no output carries a copy of the
request's past. Checked by counting the elements of every list and string that the outputs hand out,
where a list counts once per distinct object (one shared, growing list is no copy; a fresh copy per
step is). FINAL gives the whole request once; CUMULATIVE keeps its frozen per-step snapshots.
"""

from __future__ import annotations

import math

import pytest

from kvserve.core.outputs import TokenLogprob
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.output_processor import OutputKind, OutputProcessor, so_far
from kvserve.engine.wire import FrozenMetrics, RequestDelta, SampleDelta


def delta(step: int, finished: bool, n: int = 1, logprobs: bool = True) -> RequestDelta:
    samples = []
    for index in range(n):
        token = 1000 + step * n + index
        lp = (TokenLogprob(token, -0.5, 1, ((token, -0.5),)),) if logprobs else None
        samples.append(
            SampleDelta(
                index=index,
                new_token_ids=(token,),
                new_logprobs=lp,
                new_text=f"w{step % 10} ",
                finish_reason="length" if finished else None,
                stop_reason=None,
                num_cached_tokens=16,
                num_spec_proposed=0,
                num_spec_accepted=0,
                structured_complete=None,
                metrics=FrozenMetrics(0.0, 0.5, 1.0, 9.0 if finished else None, 0, (1.0 + step,)),
            )
        )
    return RequestDelta("r", tuple(samples), finished)


def run(kind: OutputKind, num_tokens: int, n: int = 1):
    processor = OutputProcessor()
    params = SamplingParams(max_tokens=num_tokens, n=n, logprobs=1)
    tracked = processor.add("r", None, [1, 2, 3], params, 0.0, kind)
    outputs = []
    for step in range(num_tokens):
        outputs += processor.process([delta(step, step == num_tokens - 1, n)])
    assert len(processor) == 0  # finished: forgotten
    return outputs, tracked


def elements_handed_out(outputs) -> int:
    """Elements of every list and string in the outputs; a list object counts once however often it
    is handed out (shared, not copied)."""
    seen: set[int] = set()
    total = 0

    def count(obj) -> None:
        nonlocal total
        if isinstance(obj, str):
            total += len(obj)
        elif isinstance(obj, list) and id(obj) not in seen:
            seen.add(id(obj))
            total += len(obj)

    for output in outputs:
        for c in output.outputs:
            values = (c.text, c.token_ids, c.logprobs, c.delta_text, c.delta_token_ids)
            for value in (*values, c.delta_logprobs, c.metrics.token_times):
                count(value)
    return total


@pytest.mark.parametrize("num_tokens", [500, 4000])
def test_a_stream_hands_out_o_n_elements_in_total(num_tokens):
    outputs, _ = run(OutputKind.DELTA, num_tokens)
    assert len(outputs) == num_tokens
    per_token = elements_handed_out(outputs) / num_tokens
    # each step: its text piece (3 chars) twice, its id twice, its logprob twice, one time; a
    # per-step copy of the past would add ~num_tokens / 2 per token on average
    assert per_token < 15, per_token


def test_the_stream_cost_per_token_is_flat_across_lengths():
    short = elements_handed_out(run(OutputKind.DELTA, 400)[0]) / 400
    long = elements_handed_out(run(OutputKind.DELTA, 4000)[0]) / 4000
    assert long < short * 1.05  # O(n) per step would make it ~10x


def test_cumulative_snapshots_copy_and_so_cost_grows_quadratically():
    """The check above can fail: frozen per-step snapshots (CUMULATIVE, by contract) are O(n^2)."""
    outputs, _ = run(OutputKind.CUMULATIVE, 400)
    assert elements_handed_out(outputs) / 400 > 400


def test_stream_deltas_add_up_to_the_whole_request():
    outputs, tracked = run(OutputKind.DELTA, 50, n=2)
    whole = so_far("r", tracked)
    for index in range(2):
        views = [o.outputs[index] for o in outputs]
        assert "".join(v.text for v in views) == whole.outputs[index].text
        assert sum((v.token_ids for v in views), []) == whole.outputs[index].token_ids
        assert [v.num_tokens for v in views] == list(range(1, 51))
        assert [e for v in views for e in v.logprobs] == whole.outputs[index].logprobs
        assert math.isclose(views[-1].cumulative_logprob, -0.5 * 50)
        assert views[-1].finish_reason == "length" and views[-2].finish_reason is None
        assert views[-1].metrics.token_times is views[0].metrics.token_times  # shared, not copied
        assert len(views[-1].metrics.token_times) == 50
    assert outputs[-1].finished and not outputs[-2].finished


def test_final_gives_the_whole_request_once_equal_to_the_last_cumulative_snapshot():
    final, _ = run(OutputKind.FINAL, 30, n=2)
    cumulative, _ = run(OutputKind.CUMULATIVE, 30, n=2)
    assert len(final) == 1 and final[0].finished
    for a, b in zip(final[0].outputs, cumulative[-1].outputs, strict=True):
        assert (a.text, a.token_ids, a.logprobs) == (b.text, b.token_ids, b.logprobs)
        assert (a.num_tokens, a.finish_reason, a.cumulative_logprob) == (
            b.num_tokens,
            b.finish_reason,
            b.cumulative_logprob,
        )
        assert a.metrics.token_times == b.metrics.token_times


def test_so_far_of_an_unfinished_request_and_an_aborted_one():
    processor = OutputProcessor()
    tracked = processor.add("r", "hi", [1], SamplingParams(max_tokens=9), 0.0, OutputKind.FINAL)
    assert processor.process([delta(0, False, logprobs=False)]) == []  # FINAL: nothing yet
    processor.process([delta(1, False, logprobs=False)])
    processor.remove("r")  # aborted: the accumulator stays readable for accounting
    partial = so_far("r", tracked)
    assert not partial.finished and partial.prompt == "hi"
    assert partial.outputs[0].text == "w0 w1 " and partial.outputs[0].num_tokens == 2
    assert partial.outputs[0].logprobs is None
    assert processor.process([delta(2, True, logprobs=False)]) == []  # late deltas are dropped
