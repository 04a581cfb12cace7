"""One owner per piece of request state (docs/structures.md, "Who owns what"): the scheduler decides
stops and their reason and fans n > 1 out; one clock stamps every time; snapshots are frozen and do
not share their metrics; a request is validated once."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.request import Request
from kvserve.engine.request_records import ValidatedRequest

EOS = 2
PROMPT = [5 + (i * 7) % 200 for i in range(21)]  # one full block of 16 and a part


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_blocks=128)


def _request(params: SamplingParams, request_id: str = "r") -> Request:
    return Request(request_id, tuple(PROMPT), params, params.max_tokens, frozenset({EOS}))


# --- stops: the scheduler decides them and their reason (its own tests: tests/sched/test_scheduler.py) ----


def test_the_engine_reports_the_schedulers_stop_reason(llm, monkeypatch):
    # A reason the engine could not derive from the tokens: it must be passed through, not re-derived.
    scheduler = llm.engine.scheduler
    real_update = scheduler.update

    def update(*args):
        return [
            dataclasses.replace(u, stop_reason=-7) if u.finish_reason == "stop" else u
            for u in real_update(*args)
        ]

    monkeypatch.setattr(scheduler, "update", update)
    params = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(7,), logit_bias={7: 100.0})
    (out,) = llm.generate([PROMPT], params)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == [7]
    assert out.outputs[0].stop_reason == -7


# --- n > 1: the scheduler fans out and holds samples 1..n-1 ------------------------------------------


def test_the_engine_holds_no_samples_back(llm):
    engine = llm.engine
    engine.add_request("fan", PROMPT, SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1))
    assert engine.num_waiting_samples == engine.scheduler.num_waiting == 3
    assert not hasattr(next(iter(engine._requests.values())), "pending")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()


# --- one clock, frozen snapshots, no sentinels, no write-only fields ---------------------------------


def test_every_time_comes_from_one_reading_of_the_injected_clock(llama_dir):
    ticks = itertools.count(1000)
    readings: list[float] = []

    def clock() -> float:
        readings.append(float(next(ticks)))
        return readings[-1]

    llm = LLM(str(llama_dir), num_blocks=64)
    llm.engine.clock = clock
    stamps = {}
    steps = llm.generate_steps([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))
    for changed in steps:
        for request in llm.engine.scheduler.requests.values():
            stamps[request.request_id] = request.first_scheduled_time
        last = changed
    m = last[0].metrics
    assert m.arrival_time == readings[0]  # add_request read the clock: nothing else did
    # the scheduler's stamp and the metric are the one reading taken for that step
    assert m.first_scheduled_time == stamps[last[0].request_id] == readings[1]
    assert m.first_token_time == m.token_times[0] == readings[2]
    assert set(m.token_times) | {m.finished_time} <= set(readings)


def test_snapshots_are_frozen_and_share_no_metrics(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    snapshots = [changed[0] for changed in llm.generate_steps([PROMPT], params)]
    assert len(snapshots) == 4
    metrics = [s.metrics for s in snapshots]
    assert len({id(m) for m in metrics}) == 4
    assert len({id(m.token_times) for m in metrics}) == 4
    assert [len(m.token_times) for m in metrics] == [1, 2, 3, 4]  # earlier ones did not grow
    assert all(s.metrics is s.outputs[0].metrics for s in snapshots)
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics[0].finished_time = 1.0


def test_no_sentinels_and_no_write_only_request_fields(llm):
    names = {f.name for f in dataclasses.fields(Request)}
    assert not names & {"arrival_time", "num_preemptions", "num_spec_proposed", "num_spec_accepted"}
    assert _request(SamplingParams()).num_cached_tokens == 0
    engine = llm.engine
    # An aborted request emits nothing (its caller stopped listening) and leaves nothing behind.
    engine.add_request("never-scheduled", PROMPT, SamplingParams(max_tokens=2))
    assert engine.abort_request("never-scheduled") is None
    assert not engine.has_unfinished_requests()
    # Before it is scheduled a request reports a real count (0), never a sentinel.
    engine.add_request("counted", PROMPT, SamplingParams(max_tokens=1))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["counted"]
    assert outputs[0].num_cached_tokens >= 0 and outputs[0].outputs[0].num_cached_tokens >= 0
    assert outputs[0].metrics.first_scheduled_time is not None
    assert outputs[0].finished and not engine.has_unfinished_requests()


# --- validation: once per request, at intake ----------------------------------------------------------


def test_each_request_is_validated_once(llm, monkeypatch):
    calls = []
    real = llm.engine.validate
    monkeypatch.setattr(llm.engine, "validate", lambda *a: calls.append(a) or real(*a))
    prompts = [PROMPT, PROMPT[:9], PROMPT[:5]]
    llm.generate(prompts, SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=3))
    assert len(calls) == len(prompts)
    calls.clear()
    list(llm.generate_steps(PROMPT, SamplingParams(max_tokens=2)))
    assert len(calls) == 1


def test_a_validated_request_is_added_as_is(llm):
    engine = llm.engine
    validated = engine.validate(PROMPT, SamplingParams(max_tokens=2))
    assert validated == ValidatedRequest(tuple(PROMPT), SamplingParams(max_tokens=2), 2)
    engine.add_request("as-is", validated)
    with pytest.raises(Exception, match="params differ"):
        engine.add_request("other", validated, SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()


def test_the_runner_refuses_a_token_count_that_disagrees_with_the_schedulers(llama_dir):
    from kvserve.core.outputs import NewRequestData, ScheduledChunk, SchedulerOutput

    runner = LLM(str(llama_dir), num_blocks=8, enable_prefix_caching=False).engine.runner
    params = SamplingParams(max_tokens=4, temperature=0)
    new = NewRequestData("x", tuple(PROMPT), params, frozenset({EOS}), 4)
    first = ScheduledChunk("x", tuple(PROMPT), 0, (0, 1), True, 0)
    (sampled,) = runner.execute(SchedulerOutput((new,), (first,), ())).sampled
    # the scheduler committed that token: the next chunk says 1 output token, and the runner agrees
    ok = ScheduledChunk("x", sampled.token_ids, len(PROMPT), (0, 1), True, 1)
    runner.execute(SchedulerOutput((), (ok,), ()))
    drifted = ScheduledChunk("x", (9,), len(PROMPT) + 1, (0, 1), True, 5)
    with pytest.raises(RuntimeError, match="the runner holds 2 output tokens, the scheduler 5"):
        runner.execute(SchedulerOutput((), (drifted,), ()))
