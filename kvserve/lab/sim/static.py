"""Static batching (docs/scheduling.md), a policy of its own: nobody joins a running batch.

A batch of up to `batch_size` waiting requests is dispatched when it is full or when its oldest
request has waited `timeout_s`, and only when no batch is running. Prompts are padded to the
batch's longest prompt; the batch decodes until its longest output ends, every member computing a
(padded) token each step, so a short answer still holds its slot and its cache to the end.

Memory admission uses the engine's KVCacheManager: each member reserves blocks for the padded
prompt plus the batch's longest output; members are taken FCFS while that fits the pool. Steps are
expressed as `SchedulerOutput`s (padded token ids, real block ids) so any cost model prices them
the same way as the continuous scheduler's steps.
"""

from __future__ import annotations

from collections import deque

from kvserve.core.outputs import ScheduledChunk, SchedulerOutput
from kvserve.core.request import Request
from kvserve.kv.groups import KVLayout
from kvserve.kv.manager import KVCacheManager
from kvserve.lab.sim.cost import CostModel
from kvserve.lab.sim.loop import StepHook
from kvserve.lab.sim.timeline import (
    FAKE_TOKEN_ID,
    RequestTimeline,
    SimRun,
    make_request,
    validation_error,
)
from kvserve.lab.sim.workload import SimError, SimRequest


def _padded_tokens(members: list[RequestTimeline]) -> tuple[int, int]:
    """(longest prompt, longest output) of a batch."""
    return (
        max(t.request.num_prompt_tokens for t in members),
        max(t.request.num_output_tokens for t in members),
    )


def _take_batch(
    queue: deque[RequestTimeline], batch_size: int, kv: KVCacheManager
) -> list[RequestTimeline]:
    """FCFS from the queue head while the padded batch fits the (empty) pool."""
    batch: list[RequestTimeline] = []
    while queue and len(batch) < batch_size:
        prompt, output = _padded_tokens(batch + [queue[0]])
        if (len(batch) + 1) * kv.num_blocks_for(prompt + output) > kv.num_free_blocks:
            break
        batch.append(queue.popleft())
    if not batch:
        raise SimError("static batching: the first waiting request does not fit the KV cache")
    return batch


def _step(
    members: list[tuple[RequestTimeline, Request]],
    kv: KVCacheManager,
    num_new: int,
    start: int,
    num_output: int,
) -> SchedulerOutput:
    chunks = tuple(
        ScheduledChunk(
            request_id=t.request_id,
            token_ids=(FAKE_TOKEN_ID,) * num_new,
            start_position=start,
            new_block_ids=tuple(kv.block_ids(t.request_id)),  # whole (block_offset 0): no runner
            sample=True,
            num_output_tokens=num_output,
        )
        for t, _ in members
    )
    # new_requests stays empty: it carries per-request state for a runner, which the sim has not.
    return SchedulerOutput((), chunks, ())


def _run_batch(
    batch: list[RequestTimeline],
    kv: KVCacheManager,
    cost_model: CostModel,
    now: float,
    run: SimRun,
    on_step: StepHook | None,
) -> float:
    """Run one padded batch from `now` to its end; returns the end time."""
    prompt, output = _padded_tokens(batch)
    members = []
    for timeline in batch:
        request = make_request(timeline.request)
        if not kv.allocate_slots(request, prompt + output):
            raise AssertionError("static batch admission let in a batch that does not fit")
        timeline.first_scheduled_s = now
        members.append((timeline, request))
    run.peak_kv_usage = max(run.peak_kv_usage, kv.usage)
    # Step k computes output token k + 1 for everyone (the prompt first, padded), whether or not a
    # member still needs it.
    for k in range(output):
        if k == 0:
            out = _step(members, kv, prompt, 0, 0)
        else:
            out = _step(members, kv, 1, prompt + k - 1, k)
        step_s = cost_model.step_s(out)
        now += step_s
        run.busy_s += step_s
        run.num_steps += 1
        for timeline, _ in members:
            if k < timeline.request.num_output_tokens:
                timeline.token_times_s.append(now)
                if k + 1 == timeline.request.num_output_tokens:
                    timeline.finish_s = now
        if on_step is not None:
            on_step(kv, out, now)
    for _, request in members:
        kv.free(request)
    return now


def simulate_static(
    requests: tuple[SimRequest, ...],
    cost_model: CostModel,
    batch_size: int,
    timeout_s: float,
    num_blocks: int,
    block_size: int = 16,
    max_model_len: int = 1 << 30,
    on_step: StepHook | None = None,
    layout: KVLayout | None = None,
) -> SimRun:
    """`layout`: a hybrid model's KV groups, as the engine keeps them (kv/groups.py)."""
    if batch_size < 1 or timeout_s < 0:
        raise SimError("static batching needs batch_size >= 1 and timeout >= 0")
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, layout=layout)
    timelines = [RequestTimeline(r) for r in requests]
    pending = deque(sorted(timelines, key=lambda t: (t.request.arrival_s, t.request.index)))
    queue: deque[RequestTimeline] = deque()
    run = SimRun("static", timelines, num_blocks=num_blocks)
    now = 0.0
    while pending or queue:
        while pending and pending[0].request.arrival_s <= now:
            timeline = pending.popleft()
            if timeline.reject(
                validation_error(timeline.request, max_model_len, num_blocks, block_size, layout)
            ):
                queue.append(timeline)
        if not queue:
            if pending:
                now = max(now, pending[0].request.arrival_s)
            continue
        deadline = queue[0].request.arrival_s + timeout_s
        if len(queue) < batch_size and now < deadline:
            now = min(deadline, pending[0].request.arrival_s) if pending else deadline
            continue
        now = _run_batch(_take_batch(queue, batch_size, kv), kv, cost_model, now, run, on_step)
    run.end_s = now
    return run
