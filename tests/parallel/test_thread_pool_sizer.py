"""The adaptive thread policy (kvserve/threads.py `ThreadPoolSizer`, `next_thread_count`,
`RunDelayMeter`; docs/performance.md "Threads"): the rule as a pure function; the policy driven by a
fake clock and fake CPU times with known answers; the meter against fake schedstat files and against
a real competitor on one CPU; and the engine's outputs, which must not depend on how many threads
each step ran on (the oracle: the same requests at a fixed thread count)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from kvserve.core.errors import InvalidRequestError
from kvserve.threads import RunDelayMeter, SchedTimes, ThreadPoolSizer, next_thread_count


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeMeter:
    """CPU time and run delay that grow as the test reports each step."""

    available = True

    def __init__(self) -> None:
        self.cpu_s = self.delay_s = 0.0

    def read(self) -> SchedTimes:
        return SchedTimes(self.cpu_s, self.delay_s)


def _run(sizer: ThreadPoolSizer, clock: FakeClock, meter: FakeMeter, machine, steps: int,
         step_s=0.0625):  # fmt: skip
    """`steps` steps of `step_s` (a binary fraction: the fake clock adds up exactly);
    `machine(threads)` is (share of each thread-second lost, cores used) at that pool size."""
    seen = []
    for _ in range(steps):
        threads = sizer.threads
        seen.append(threads)
        clock.now += step_s
        lost, cores = machine(threads)
        meter.delay_s += lost * step_s * threads
        meter.cpu_s += cores * step_s
        sizer.observe(step_s)
    return seen


def _quiet(threads: int) -> tuple[float, float]:
    return 0.01, 0.9 * threads


def _neighbour(threads: int) -> tuple[float, float]:
    """One busy core beside a 2-core pool: 3 threads on 2 cores; the pool waits at its barriers
    for the delayed thread and gets about one core whatever its size."""
    return (1 / 3, 1.0) if threads == 2 else (0.0, 1.0)


def _light_neighbour(threads: int) -> tuple[float, float]:
    """The API process and the load generator beside the engine: they take CPU now and then, the
    pool still gets well over one core with 2 threads."""
    return (0.3, 1.6) if threads == 2 else (0.05, 1.0)


def _sizer(max_threads=2, **kw):
    clock, meter = FakeClock(), FakeMeter()
    return ThreadPoolSizer(max_threads, meter, clock=clock, **kw), clock, meter


@pytest.mark.parametrize(
    ("threads", "lost", "cores", "expected"),
    [
        (2, 0.01, 1.9, 2),  # quiet: every thread
        (2, 0.01, 0.8, 2),  # quiet but host-bound steps: no neighbour to yield to
        (2, 0.33, 1.0, 1),  # a busy core: the second thread buys nothing
        (2, 0.30, 1.6, 2),  # a light neighbour: the second thread still buys 0.6 of a core
        (2, 0.30, 1.5, 2),  # exactly the margin: kept
        (2, 0.30, 1.49, 1),
        (4, 0.40, 2.4, 3),  # 4 threads that get 2.4 cores: 3 would get as much
        (4, 0.40, 3.6, 4),
        (1, 0.90, 0.3, 1),  # never below one thread
    ],
)
def test_the_rule_drops_a_thread_only_where_it_buys_less_than_the_margin(
    threads, lost, cores, expected
):
    assert next_thread_count(threads, lost, cores, threshold=0.2, margin=0.5) == expected


def test_a_quiet_machine_keeps_every_thread():
    sizer, clock, meter = _sizer()
    assert set(_run(sizer, clock, meter, _quiet, 200)) == {2}
    assert sizer.num_changes == 0 and sizer.last_lost == pytest.approx(0.01)
    assert sizer.last_cores == pytest.approx(1.8)


def test_a_light_neighbour_keeps_every_thread():
    sizer, clock, meter = _sizer()
    assert set(_run(sizer, clock, meter, _light_neighbour, 200)) == {2}
    assert sizer.num_changes == 0 and sizer.last_lost == pytest.approx(0.3)


def test_a_neighbour_drops_a_thread_after_one_window_and_probes_back_with_growing_waits():
    sizer, clock, meter = _sizer(window_s=0.25, min_steps=3, probe_s=1.0, max_probe_s=4.0)
    seen = _run(sizer, clock, meter, _neighbour, 400)  # 25 s of 1/16 s steps
    assert seen[:4] == [2, 2, 2, 2]  # the first window: 4 steps = 0.25 s
    assert seen[4] == 1
    # each probe is one 2-thread window (4 steps); the waits between them: 1, 2, 4, 4, 4 ... seconds
    runs, start = [], None
    for i, threads in enumerate(seen[4:], start=4):
        if threads == 2 and start is None:
            start = i
        if threads == 1 and start is not None:
            runs.append((start, i - start))
            start = None
    assert all(length == 4 for _, length in runs)
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(runs, runs[1:], strict=False)]
    assert gaps[:4] == [2 * 16, 4 * 16, 4 * 16, 4 * 16]  # 1/16 s steps at 1 thread
    assert runs[0][0] == 4 + 16  # the first probe one second after the drop
    assert sum(threads == 2 for threads in seen[4:]) / len(seen[4:]) < 0.1  # probing costs little


def test_the_full_pool_returns_when_the_neighbour_leaves_and_the_wait_resets():
    sizer, clock, meter = _sizer(probe_s=1.0, max_probe_s=8.0)
    _run(sizer, clock, meter, _neighbour, 200)  # 10 s beside the neighbour
    assert sizer.threads == 1
    seen = _run(sizer, clock, meter, _quiet, 400)  # it left
    first_full = seen.index(2)
    assert first_full <= 8 * 16 + 1  # within the longest wait
    assert set(seen[first_full:]) == {2}
    changes = sizer.num_changes
    _run(sizer, clock, meter, _neighbour, 4)  # it is back: one window, then down, probe after 1 s
    assert sizer.threads == 1 and sizer.num_changes == changes + 1
    seen = _run(sizer, clock, meter, _neighbour, 17)
    assert seen[-1] == 2 and seen.count(2) == 1


def test_a_window_needs_min_steps_as_well_as_window_s():
    sizer, clock, meter = _sizer(window_s=0.2, min_steps=3)
    assert _run(sizer, clock, meter, _neighbour, 3, step_s=1.0) == [2, 2, 2]
    assert sizer.threads == 1  # decided at the third step, not the first


def test_a_larger_pool_steps_down_one_thread_a_window():
    def two_busy_cores(threads: int) -> tuple[float, float]:  # 4 cores, 2 of them busy
        return max(0.0, 1 - 4 / (threads + 2)), 2.0

    sizer, clock, meter = _sizer(max_threads=4, probe_s=100.0, threshold=0.15)
    seen = _run(sizer, clock, meter, two_busy_cores, 12)
    assert seen == [4] * 4 + [3] * 4 + [2] * 4
    assert _run(sizer, clock, meter, two_busy_cores, 20) == [2] * 20  # 2 threads lose nothing


# --- the meter ------------------------------------------------------------------------------------------


def _schedstat(task_dir, tid: int, delay_ns: int, cpu_ns: int = 123) -> None:
    (task_dir / str(tid)).mkdir(exist_ok=True)
    (task_dir / str(tid) / "schedstat").write_text(f"{cpu_ns} {delay_ns} 7\n")


def test_the_meter_sums_its_threads_times_from_when_it_first_sees_them(tmp_path):
    clock = FakeClock()
    _schedstat(tmp_path, 1, 5_000_000_000, 9_000_000_000)  # times before the meter do not count
    meter = RunDelayMeter(str(tmp_path), rescan_s=1.0, clock=clock)
    assert meter.available and meter.read() == (0.0, 0.0)
    _schedstat(tmp_path, 1, 5_250_000_000, 9_500_000_000)
    _schedstat(tmp_path, 2, 1_000_000_000, 3_000_000_000)  # a new thread: unseen until the scan
    assert meter.read() == pytest.approx((0.5, 0.25))
    clock.now = 1.0
    assert meter.read() == pytest.approx((0.5, 0.25))  # thread 2 is seen now, from its 1 s / 3 s
    _schedstat(tmp_path, 2, 1_500_000_000, 3_125_000_000)
    for name in os.listdir(tmp_path / "1"):
        os.remove(tmp_path / "1" / name)
    os.rmdir(tmp_path / "1")  # thread 1 ended: its share stays counted, the totals never fall
    assert meter.read() == pytest.approx((0.625, 0.75))
    meter.close()


def test_the_meter_is_unavailable_without_schedstat(tmp_path):
    assert not RunDelayMeter(str(tmp_path / "missing")).available


@pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat") or not hasattr(os, "sched_setaffinity"),
    reason="Linux schedstat and affinity",
)
def test_the_meter_sees_a_competitor_on_the_same_cpu():
    """This process and a busy loop pinned to one CPU: whenever both are runnable one waits, so
    the run delay grows (no claim about how much: that depends on the scheduler)."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    loop = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        os.sched_setaffinity(0, {cpu})
        meter = RunDelayMeter()
        start = meter.read()
        spent = time.process_time()
        while meter.read().delay_s == start.delay_s and time.process_time() - spent < 30.0:
            sum(range(10_000))  # keep runnable; stop as soon as any delay shows
        end = meter.read()
        assert end.delay_s > start.delay_s and end.cpu_s > start.cpu_s
    finally:
        os.sched_setaffinity(0, before)
        loop.kill()
        loop.wait()


# --- the engine -----------------------------------------------------------------------------------------


class AlternatingMeter:
    """Reports a lost share far above the threshold and no CPU time at every read, so that with
    windows of one step and no wait before a probe the pool alternates 2, 1, 2, 1 ... threads step
    by step."""

    available = True

    def __init__(self) -> None:
        self.total = 0.0

    def read(self) -> SchedTimes:
        self.total += 100.0
        return SchedTimes(0.0, self.total)


def _generate(llm, prompts, params) -> list:
    outs = llm.generate(prompts, params)
    return [
        (o.outputs[0].token_ids, [(d.logprob, d.top) for d in o.outputs[0].logprobs]) for o in outs
    ]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_steps_on_changing_thread_counts_give_the_fixed_counts_bits(gpt2_model_dir, two_threads):
    from kvserve import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 40, 130, 17)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    fixed = LLM(gpt2_model_dir, thread_policy="fixed", enable_prefix_caching=False)
    assert fixed.engine.runner.thread_pool is None
    expected = _generate(fixed, prompts, params)
    torch.set_num_threads(1)
    assert _generate(fixed, prompts, params) == expected  # the oracle holds at 1 thread too
    torch.set_num_threads(2)
    adaptive = LLM(gpt2_model_dir, enable_prefix_caching=False)
    runner = adaptive.engine.runner
    assert runner.thread_pool is not None and runner.thread_pool.max_threads == 2
    runner.thread_pool = ThreadPoolSizer(2, AlternatingMeter(), window_s=0.0, min_steps=1, probe_s=0.0)
    used = []
    original = runner._execute

    def spy(chunks):
        used.append(torch.get_num_threads())
        return original(chunks)

    runner._execute = spy
    assert _generate(adaptive, prompts, params) == expected
    assert set(used) == {1, 2} and runner.num_thread_changes >= len(used) - 1


def test_the_policy_is_validated_and_fixed_keeps_no_sizer(gpt2_model_dir, two_threads):
    from kvserve import LLM

    with pytest.raises(InvalidRequestError, match="thread_policy"):
        LLM(gpt2_model_dir, thread_policy="sometimes")
    one = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert LLM(gpt2_model_dir).engine.runner.thread_pool is None  # nothing to drop
    finally:
        torch.set_num_threads(one)
