"""The load driver with a fake sender (no network): order, phases, concurrency, closed loop,
Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from kvserve.lab.bench.loadgen import LoadPlan, run_load
from kvserve.lab.bench.records import RequestRecord, RequestSpec


class FakeSender:
    def __init__(self, delay_s: float = 0.005, sigint_at: int | None = None) -> None:
        self.delay_s, self.sigint_at = delay_s, sigint_at
        self.active = self.peak = self.calls = 0

    async def __call__(self, spec, rid, phase, t_sched, origin, sink):
        t_send = time.perf_counter() - origin
        self.calls += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        outcome = "ok"
        try:
            if self.calls == self.sigint_at:
                os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.active -= 1
            rec = RequestRecord(rid, spec.index, phase, outcome, t_sched, t_send,
                                time.perf_counter() - origin, spec.max_tokens)  # fmt: skip
            sink[rid] = (rec, "text")
        return rec, "text"


def specs(n: int) -> tuple[RequestSpec, ...]:
    return tuple(RequestSpec(i, f"prompt {i}", 2, 4) for i in range(n))


def test_open_loop_sends_in_schedule_order_and_labels_phases():
    offsets = tuple(0.002 * i for i in range(20))
    plan = LoadPlan(specs(20), num_warmup=3, offsets_s=offsets)
    result = asyncio.run(run_load(plan, FakeSender()))
    assert len(result.records) == 20 and not result.interrupted
    assert [r.phase for r in result.records] == ["warmup"] * 3 + ["measured"] * 17
    sends = [r.t_send_s for r in result.records]
    assert sends == sorted(sends)
    assert all(r.t_send_s >= r.t_scheduled_s for r in result.records)  # lag is never negative
    scheduled = [r.t_scheduled_s - result.records[0].t_scheduled_s for r in result.records]
    assert all(abs(a - b) < 1e-9 for a, b in zip(scheduled, offsets, strict=True))  # absolute times
    assert result.loop_lag_s and result.wall_s > 0 and result.cpu_s >= 0


def test_open_loop_concurrency_cap():
    sender = FakeSender(delay_s=0.01)
    plan = LoadPlan(specs(12), num_warmup=0, offsets_s=(0.0,) * 12, max_concurrency=3)
    result = asyncio.run(run_load(plan, sender))
    assert sender.peak == 3 and len(result.records) == 12
    assert all(r.outcome == "ok" for r in result.records)


def test_closed_loop_users_and_duration():
    sender = FakeSender(delay_s=0.002)
    plan = LoadPlan(specs(30), num_warmup=2, offsets_s=None, max_concurrency=4)
    result = asyncio.run(run_load(plan, sender))
    assert sender.peak == 4 and len(result.records) == 30
    sender = FakeSender(delay_s=0.02)
    plan = LoadPlan(specs(500), num_warmup=2, offsets_s=None, max_concurrency=2, duration_s=0.05)
    result = asyncio.run(run_load(plan, sender))
    # stops taking new measured requests after the duration; no request is lost
    assert 3 <= len(result.records) < 500
    assert all(r.outcome == "ok" for r in result.records)


def test_ctrl_c_stops_and_keeps_what_was_measured():
    sender = FakeSender(delay_s=0.5, sigint_at=5)
    plan = LoadPlan(specs(40), num_warmup=0, offsets_s=(0.0,) * 40, max_concurrency=5)
    result = asyncio.run(run_load(plan, sender))
    assert result.interrupted
    outcomes = [r.outcome for r in result.records]
    assert outcomes.count("cancelled") == len(outcomes)
    assert sum(r.t_send_s is not None for r in result.records) == 5  # in flight when interrupted
    assert any(r.t_send_s is None for r in result.records)  # were waiting for a concurrency slot
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
