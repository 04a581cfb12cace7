"""The simulator: a digital twin of the engine's scheduler and KV manager (design.md).

It must make exactly the scheduler's decisions, be deterministic, keep the KV invariants, implement
the policies of docs/scheduling.md as defined, and price steps with the planner's arithmetic.
"""

from __future__ import annotations

import math

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import RunnerOutput, SampledTokens, ScheduledChunk, SchedulerOutput
from kvserve.kv.manager import KVCacheManager
from kvserve.lab.plan import arith, load_model
from kvserve.lab.sim.cost import RooflineStepCost, StepLoad
from kvserve.lab.sim.loop import simulate_continuous
from kvserve.lab.sim.study import EngineShape, Policy, run_policy
from kvserve.lab.sim.timeline import FAKE_TOKEN_ID, make_request
from kvserve.lab.sim.workload import SimRequest
from kvserve.sched.scheduler import Scheduler

BLOCK = 4


class RecordingCost:
    """A cost model that records every decision it is asked to price; each step takes 1 s."""

    def __init__(self, step_s: float = 1.0) -> None:
        self.outputs: list[SchedulerOutput] = []
        self._step_s = step_s

    def step_s(self, scheduler_output: SchedulerOutput) -> float:
        self.outputs.append(scheduler_output)
        return self._step_s

    def describe(self) -> dict:
        return {"kind": "recording"}


def mixed_requests() -> tuple[SimRequest, ...]:
    # (arrival, prompt, output): bursts, a prompt longer than the token budget, and an idle gap.
    rows = [
        (0.0, 30, 12),
        (0.0, 10, 25),
        (0.0, 70, 6),
        (0.5, 18, 30),
        (2.0, 40, 9),
        (2.0, 12, 14),
        (3.5, 55, 20),
        (90.0, 20, 5),
    ]
    return tuple(SimRequest(i, t, p, o) for i, (t, p, o) in enumerate(rows))


def config(admission: str = "on_demand", budget: int = 24) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=128, admission=admission
    )


def drive_by_hand(requests, sched_config, num_blocks, step_s=1.0) -> list[SchedulerOutput]:
    """The engine's loop (EngineCore.step) with a runner that samples FAKE_TOKEN_ID; requests join
    between steps once their arrival time has passed; idle time jumps to the next arrival."""
    scheduler = Scheduler(sched_config, KVCacheManager(num_blocks, BLOCK))
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    outputs, now = [], 0.0
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival_s <= now:
            scheduler.add_request(make_request(pending.pop(0)))
        out = scheduler.schedule(now)
        if out.empty:
            now = pending[0].arrival_s
            continue
        outputs.append(out)
        sampled = tuple(
            SampledTokens(c.request_id, (FAKE_TOKEN_ID,)) for c in out.chunks if c.sample
        )
        scheduler.update(out, RunnerOutput(sampled))
        now += step_s
    return outputs


def test_simulator_makes_exactly_the_schedulers_decisions():
    requests = mixed_requests()
    recorder = RecordingCost()
    run = simulate_continuous(requests, recorder, config(), num_blocks=30, block_size=BLOCK)
    by_hand = drive_by_hand(requests, config(), num_blocks=30)
    assert recorder.outputs == by_hand  # request ids, token ids, positions, block ids, preemptions
    # ... and the sequence is not a trivial one: chunked prompts, preemptions and an idle gap.
    chunks = [c for out in by_hand for c in out.chunks]
    assert any(c.start_position > 0 and c.num_tokens > 1 for c in chunks)
    assert sum(len(out.preempted_request_ids) for out in by_hand) == run.num_preemptions > 0
    assert run.timelines[-1].first_scheduled_s == 90.0
    # Every request got exactly its output length, at step ends of the simulated clock.
    for t in run.timelines:
        assert len(t.token_times_s) == t.request.num_output_tokens
        assert t.finish_s == t.token_times_s[-1]
        assert all(x == int(x) for x in t.token_times_s) or t.request.arrival_s == 90.0


def test_simulation_is_deterministic_for_a_seed():
    from kvserve.lab.bench.workloads import LengthDist
    from kvserve.lab.sim.workload import Workload

    def run(seed: int):
        workload = Workload(
            LengthDist("uniform", 8, 60), LengthDist("uniform", 4, 40), 40, seed=seed
        )
        shape = EngineShape(num_blocks=60, max_model_len=128, block_size=BLOCK, max_num_seqs=6)
        sim = run_policy(Policy.parse("on_demand"), shape, smol_cost(), workload.requests(2000.0))
        return [r.to_json() for r in sim.records()], sim.num_preemptions

    first, again, other = run(3), run(3), run(4)
    assert first == again
    assert first[1] > 0  # the small cache makes it preempt: the determinism covers that path
    assert first != other


def smol_cost(step_overhead_s: float = 0.0) -> RooflineStepCost:
    model = load_model("SmolLM2-135M")
    k = arith.kv_bytes_per_token(model, 2)
    roofline = arith.RooflineCost(model, model.num_params * 2.0, k, 1e12, 1e14, 0.5)
    return RooflineStepCost(roofline, step_overhead_s)


POLICIES = ("static", "reserve", "on_demand", "reserve-chunked", "on_demand-chunked")


@pytest.mark.parametrize("name", POLICIES)
def test_kv_invariants_hold_after_every_step_and_the_pool_ends_free(name):
    shape = EngineShape(
        num_blocks=40,
        max_model_len=128,
        block_size=BLOCK,
        max_num_seqs=4,
        chunk_tokens=16,
        static_batch_size=3,
        static_timeout_s=0.5,
    )
    seen: list = []

    def check(kv: KVCacheManager, out: SchedulerOutput, now: float) -> None:
        kv.check_invariants()
        seen.append(kv)

    run = run_policy(Policy.parse(name), shape, smol_cost(), mixed_requests(), on_step=check)
    kv = seen[-1]
    assert len(seen) == run.num_steps > 0
    assert kv.num_free_blocks == kv.num_blocks  # every block returned (cached ones are free too)
    assert all(t.finish_s is not None for t in run.timelines)


def test_static_never_admits_into_a_running_batch():
    shape = EngineShape(
        num_blocks=200,
        max_model_len=128,
        block_size=BLOCK,
        static_batch_size=3,
        static_timeout_s=1.0,
    )
    steps: list[SchedulerOutput] = []
    run = run_policy(
        Policy.parse("static"),
        shape,
        smol_cost(),
        mixed_requests(),
        on_step=lambda kv, out, now: steps.append(out),
    )
    batches: list[list[SchedulerOutput]] = []
    for out in steps:
        if out.chunks[0].start_position == 0:  # a padded prompt step opens a batch
            batches.append([])
        batches[-1].append(out)
    for batch in batches:
        ids = {c.request_id for c in batch[0].chunks}
        prompt = batch[0].chunks[0].num_tokens
        assert 1 <= len(ids) <= 3
        assert all(c.num_tokens == prompt for c in batch[0].chunks)  # padded to the longest prompt
        for k, out in enumerate(batch[1:], start=1):
            assert {c.request_id for c in out.chunks} == ids  # nobody joins, nobody leaves
            assert all(c.start_position == prompt + k - 1 and c.num_tokens == 1 for c in out.chunks)
        longest = max(run.timelines[int(i.split("-")[1])].request.num_output_tokens for i in ids)
        assert len(batch) == longest  # runs until its longest output ends
    # A batch that is not full waits for the timeout after its oldest arrival (the first batch:
    # three requests at t = 0 fill it at once; the last request arrives alone at t = 90).
    assert run.timelines[0].first_scheduled_s == 0.0
    assert run.timelines[-1].first_scheduled_s == pytest.approx(91.0)


def test_reserve_never_preempts_and_on_demand_with_a_small_cache_does():
    shape = EngineShape(num_blocks=30, max_model_len=128, block_size=BLOCK, max_num_seqs=4)
    reserve = run_policy(Policy.parse("reserve"), shape, RecordingCost(), mixed_requests())
    on_demand = run_policy(Policy.parse("on_demand"), shape, RecordingCost(), mixed_requests())
    assert reserve.num_preemptions == 0
    assert on_demand.num_preemptions > 0
    assert sum(t.num_preemptions for t in on_demand.timelines) == on_demand.num_preemptions
    # Preempted requests still emit exactly their output length (recompute keeps emitted tokens).
    assert all(len(t.token_times_s) == t.request.num_output_tokens for t in on_demand.timelines)


def test_chunked_prefill_bounds_the_tokens_of_every_step():
    shape = EngineShape(num_blocks=400, max_model_len=128, block_size=BLOCK, chunk_tokens=16)
    chunked, unchunked = RecordingCost(), RecordingCost()
    run_policy(Policy.parse("on_demand-chunked"), shape, chunked, mixed_requests())
    run_policy(Policy.parse("on_demand"), shape, unchunked, mixed_requests())
    assert max(out.num_scheduled_tokens for out in chunked.outputs) <= 16
    # Without it, a whole prompt runs in one step beside the decodes.
    assert max(out.num_scheduled_tokens for out in unchunked.outputs) >= 70


def decode_step(contexts: list[int]) -> SchedulerOutput:
    chunks = tuple(
        ScheduledChunk(f"r{i}", (FAKE_TOKEN_ID,), start, (0,), True, 1)
        for i, start in enumerate(contexts)
    )
    return SchedulerOutput((), chunks, ())


@pytest.mark.parametrize("contexts", [[0], [511], [100, 2000, 37, 4096], list(range(0, 6400, 100))])
def test_roofline_decode_step_is_the_planners_decode_step_formula(contexts):
    cost = smol_cost()
    mean_context = sum(s + 1 for s in contexts) / len(contexts)  # cached tokens + the new one
    expected = cost.roofline.decode_step_s(len(contexts), mean_context)
    assert cost.step_s(decode_step(contexts)) == pytest.approx(expected, rel=1e-12)


def test_roofline_prompt_chunk_is_the_planners_prefill_and_steps_add_up():
    cost = smol_cost()
    prompt = ScheduledChunk("p", (FAKE_TOKEN_ID,) * 300, 200, (0,), False, 0)
    alone = cost.step_s(SchedulerOutput((), (prompt,), ()))
    assert alone == pytest.approx(cost.roofline.prefill_s(300, 200), rel=1e-12)
    # A mixed step is the max of its summed bytes and summed (peak-equivalent) FLOPs.
    mixed = SchedulerOutput((), (prompt,) + decode_step([10, 20]).chunks, ())
    r = cost.roofline
    load = StepLoad.of(mixed)
    decode_flops, prompt_flops = cost.step_flops(load)
    assert decode_flops == pytest.approx(arith.decode_step_flops(r.model, 2, 16.0), rel=1e-12)
    assert prompt_flops == pytest.approx(arith.prefill_flops(r.model, 300, 200), rel=1e-12)
    bytes_ = r.weight_bytes + r.kv_bytes_per_token * (500 + 11 + 21)
    expected = max(
        bytes_ / r.bandwidth_bytes_per_s,
        (decode_flops + prompt_flops / r.mfu) / r.peak_flops_per_s,
    )
    assert cost.step_s(mixed) == pytest.approx(expected, rel=1e-12)
    overhead = smol_cost(step_overhead_s=0.002)
    assert overhead.step_s(mixed) == pytest.approx(expected + 0.002, rel=1e-12)


def test_a_lone_request_takes_the_planners_ttft_and_tpot():
    cost = smol_cost()
    shape = EngineShape(num_blocks=1000, max_model_len=4096)
    run = run_policy(Policy.parse("on_demand"), shape, cost, (SimRequest(0, 0.0, 2000, 50),))
    times = run.timelines[0].token_times_s
    assert times[0] == pytest.approx(cost.roofline.prefill_s(2000), rel=1e-12)
    for k in range(1, 50):  # the k-th decode step attends to the prompt + k tokens
        gap = times[k] - times[k - 1]
        assert gap == pytest.approx(cost.roofline.decode_step_s(1, 2000 + k), rel=1e-9)
    assert math.isclose(run.busy_s, run.end_s)
