"""The discrete-event loop of continuous batching: the engine's own Scheduler and KVCacheManager,
with a cost model in place of the model runner (design.md: the digital twin).

Each iteration does what `EngineCore.step` does, in simulated time:

    requests whose arrival time has passed are added (the engine adds them between steps)
    scheduler.schedule(now)                 -> SchedulerOutput (the real decision)
    now += cost_model.step_s(StepLoad.of(SchedulerOutput))
    scheduler.update(SchedulerOutput, fake RunnerOutput)   (one FAKE_TOKEN_ID per sampling chunk)

Tokens are stamped at the end of the step that sampled them (plus the measured delivery jitter,
when the cost model has one: kvserve.lab.sim.delivery); a request is first scheduled at the start of
its first step. When nothing can run, time jumps to the next arrival; an idle engine takes an
arrival up its pickup latency after it (a calibrated server profile's `pickup_s`), with every
request that arrived meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import RunnerOutput, SampledTokens, SchedulerOutput
from kvserve.kv.groups import KVLayout
from kvserve.kv.manager import KVCacheManager
from kvserve.lab.sim.cost import CostModel
from kvserve.lab.sim.speculative import Acceptance
from kvserve.lab.sim.timeline import (
    FAKE_TOKEN_ID,
    RequestTimeline,
    SimRun,
    make_request,
    validation_error,
)
from kvserve.lab.sim.workload import SimError, SimRequest
from kvserve.sched.scheduler import Scheduler

# Called after every step with the KV manager, the step's decision and the simulated time at its
# end: tests check invariants and record decisions here.
StepHook = Callable[[KVCacheManager, SchedulerOutput, float], None]


def fake_runner_output(
    scheduler_output: SchedulerOutput, acceptance: Acceptance | None = None
) -> RunnerOutput:
    """What the runner would return, with every sampled token = FAKE_TOKEN_ID. With speculative
    decoding: a verification commits its accepted proposals plus one token, and every sampling
    chunk leaves k new proposals."""
    if acceptance is None:
        return RunnerOutput(
            tuple(
                SampledTokens(c.request_id, (FAKE_TOKEN_ID,))
                for c in scheduler_output.chunks
                if c.sample
            )
        )
    proposals = (FAKE_TOKEN_ID,) * acceptance.spec.num_speculative_tokens
    out = []
    for c in scheduler_output.chunks:
        if c.sample:
            accepted = acceptance.num_accepted(c.num_spec_tokens) if c.num_spec_tokens else 0
            tokens = (FAKE_TOKEN_ID,) * (accepted + 1)
            out.append(SampledTokens(c.request_id, tokens, None, accepted, proposals))
    return RunnerOutput(tuple(out))


def simulate_continuous(
    requests: tuple[SimRequest, ...],
    cost_model: CostModel,
    scheduler_config: SchedulerConfig,
    num_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    policy: str = "continuous",
    on_step: StepHook | None = None,
    acceptance: Acceptance | None = None,
    layout: KVLayout | None = None,
) -> SimRun:
    """`layout`: a hybrid model's KV groups, as the engine keeps them (kv/groups.py).

    Long: the simulated engine loop mirrors the engine's step loop one to one."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, layout)
    scheduler = Scheduler(scheduler_config, kv)
    timelines = [RequestTimeline(r) for r in requests]
    by_id = {t.request_id: t for t in timelines}
    # A calibrated server profile says how long a request takes to reach the engine loop.
    overhead_s = float(getattr(cost_model, "request_overhead_s", 0.0))
    # ... how long the idle engine takes to pick one up (a burst arriving within it shares the
    # first step: without it the simulated engine started on the first of 60 simultaneous
    # requests alone, and carried decodes through one more large prompt step than the server)
    pickup_s = float(getattr(cost_model, "pickup_s", 0.0))
    # ... and how each token's delivery to the client scatters (kvserve.lab.sim.delivery)
    delivery = getattr(cost_model, "delivery", None)
    # when each request reaches the loop: its arrival, the median overhead, its intake's spread
    ready = {
        t.request_id: t.request.arrival_s
        + max(0.0, overhead_s + (delivery.intake_s(t.request.index) if delivery else 0.0))
        for t in timelines
    }
    pending = sorted(timelines, key=lambda t: (ready[t.request_id], t.request.index))
    run = SimRun(policy, timelines, num_blocks=num_blocks)
    now = 0.0
    next_arrival = 0
    while next_arrival < len(pending) or scheduler.has_unfinished():
        if pickup_s and next_arrival < len(pending) and not scheduler.has_unfinished():
            # idle: the engine takes up the next arrival pickup_s after it, with what came since
            now = max(now, ready[pending[next_arrival].request_id] + pickup_s)
        while next_arrival < len(pending) and ready[pending[next_arrival].request_id] <= now:
            timeline = pending[next_arrival]
            next_arrival += 1
            sim = timeline.request
            if timeline.reject(
                validation_error(
                    sim,
                    scheduler_config.max_model_len,
                    num_blocks,
                    block_size,
                    layout,
                    scheduler_config.max_num_batched_tokens,
                )
            ):
                scheduler.add_request(make_request(sim))
        out = scheduler.schedule(now)
        if out.empty:
            if scheduler.has_unfinished() and next_arrival == len(pending):
                raise SimError(
                    f"the scheduler is stuck at t={now:.3f}s with {scheduler.num_waiting} waiting "
                    "and nothing running (a request larger than the cache?)"
                )
            if next_arrival < len(pending):
                now = max(now, ready[pending[next_arrival].request_id])
            continue
        for new in out.new_requests:
            by_id[new.request_id].first_scheduled_s = now
        for rid in out.preempted_request_ids:
            by_id[rid].num_preemptions += 1
        step_s = cost_model.step_s(out)
        now += step_s
        run.busy_s += step_s
        run.num_steps += 1
        run.peak_kv_usage = max(run.peak_kv_usage, kv.usage)
        for update in scheduler.update(out, fake_runner_output(out, acceptance)):
            timeline = by_id[update.request_id]
            times = [now] * len(update.new_token_ids)
            if delivery is not None:  # received in order, each after its own jitter
                last = timeline.token_times_s[-1] if timeline.token_times_s else 0.0
                for i, d in enumerate(delivery.delays_s(timeline.request.index, len(times))):
                    last = times[i] = max(last, now + d)
            timeline.token_times_s.extend(times)
            if update.finish_reason is not None:
                timeline.finish_s = max([now, *times])
        if on_step is not None:
            on_step(kv, out, now)
    run.num_preemptions = scheduler.stats.num_preemptions
    run.end_s = now
    return run
