"""The OpenMP settings kvserve starts with, and the one-line account of those in effect.

torch's OpenMP runtime (libgomp; the C kernels share it) reads its variables once, when torch is
imported. Unset, each idle worker thread spins 300,000 iterations before it sleeps, which beside a busy
neighbour takes the core the other thread needs (docs/performance.md "Threads" has the measurements that
chose `THREAD_DEFAULTS`). The `kvserve` command line calls `apply_thread_defaults()` before anything
imports torch; engine-core and tensor-parallel processes are spawned from it and inherit the environment.
The offline API (`from kvserve import LLM`, before torch is imported) loads torch with the defaults and
then gives the environment back as it was (`defaults_while_torch_loads`), so programs the user starts
later are unaffected; its tensor-parallel ranks get them again through `spawn_environment`.
A variable the user set wins: a default is applied only when no variable of its group is set (setting
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` keeps both of ours out).

`ThreadPoolSizer` (with `RunDelayMeter` and the rule `next_thread_count`) is the engine's adaptive
thread policy: the threads of the OpenMP thread pool the next step uses, one fewer while a neighbour
takes CPU time that the last thread cannot make up for. This module never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import NamedTuple

logger = logging.getLogger(__name__)

# Chosen from benchmarks/neighbour.py, quiet and with one busy core (docs/performance.md "Threads"): of
# the settings that kept TPOT within 2x beside a busy core, the best quiet TPOT (tied with a 1,000-spin
# count, within the rounds' spread); PASSIVE is standard OpenMP, so other runtimes honour it too.
THREAD_DEFAULTS: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}

# Variables that decide the same thing: a user's setting of one keeps the group's defaults out.
_GROUPS: tuple[tuple[str, ...], ...] = (
    ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"),  # how an idle OpenMP thread waits
    ("OMP_NUM_THREADS",),
)
THREAD_VARIABLES: tuple[str, ...] = tuple(name for group in _GROUPS for name in group)

# Names of the variables kvserve set (comma-separated), so a spawned process can tell them apart.
APPLIED_MARKER = "KVSERVE_THREAD_DEFAULTS"


# The defaults torch was loaded with where they were set only while it loaded (the offline API).
_LOADED_WITH: dict[str, str] = {}


def _group(name: str) -> tuple[str, ...]:
    return next((group for group in _GROUPS if name in group), (name,))


def thread_defaults_for(environ: Mapping[str, str]) -> dict[str, str]:
    """The `THREAD_DEFAULTS` that apply to `environ`: those no variable of whose group is set."""
    return {
        name: value
        for name, value in THREAD_DEFAULTS.items()
        if not any(other in environ for other in _group(name))
    }


def apply_thread_defaults() -> dict[str, str]:
    """Set `thread_defaults_for(os.environ)` in os.environ (and `APPLIED_MARKER`); returns what was
    set. Does nothing once torch is imported: OpenMP has read its variables, and a change would reach
    only child processes, which would then run differently from this one."""
    if "torch" in sys.modules:
        return {}
    applied = thread_defaults_for(os.environ)
    os.environ.update(applied)
    if applied:
        os.environ[APPLIED_MARKER] = ",".join(applied)
    return applied


@contextlib.contextmanager
def defaults_while_torch_loads() -> Iterator[dict[str, str]]:
    """Around the import that loads torch: the defaults are in os.environ inside, and removed again
    after (a library does not change its host's environment for good)."""
    applied = apply_thread_defaults()
    try:
        yield applied
    finally:
        for name in [*applied, APPLIED_MARKER] if applied else []:
            os.environ.pop(name, None)
        _LOADED_WITH.update(applied)


@contextlib.contextmanager
def spawn_environment() -> Iterator[None]:
    """Around starting a process that imports torch: os.environ carries the defaults this process's
    torch was loaded with, also where they were set only while it loaded."""
    missing = {name: value for name, value in _LOADED_WITH.items() if name not in os.environ}
    if missing and APPLIED_MARKER not in os.environ:
        missing[APPLIED_MARKER] = ",".join(missing)
    os.environ.update(missing)
    try:
        yield
    finally:
        for name in missing:
            os.environ.pop(name, None)


def describe_threads(num_threads: int, environ: Mapping[str, str] | None = None) -> str:
    """e.g. '2 OpenMP threads; OMP_WAIT_POLICY=PASSIVE (kvserve default)': the thread count torch uses
    and every OpenMP variable set in this process, each marked as kvserve's default or the user's."""
    if environ is None:
        loaded = {**_LOADED_WITH, APPLIED_MARKER: ",".join(_LOADED_WITH)} if _LOADED_WITH else {}
        environ = {**loaded, **os.environ}
    ours = set(environ.get(APPLIED_MARKER, "").split(","))
    settings = [
        f"{name}={environ[name]} ({'kvserve default' if name in ours else 'set by user'})"
        for name in THREAD_VARIABLES
        if name in environ
    ]
    return "; ".join([f"{num_threads} OpenMP threads", *(settings or ["libgomp defaults"])])


# --- the engine's thread pool size beside a neighbour --------------------------------------------------


class SchedTimes(NamedTuple):
    """Seconds this process's threads ran on a CPU (`cpu_s`) and waited runnable for one (`delay_s`)."""

    cpu_s: float
    delay_s: float


class RunDelayMeter:
    """What this process's threads got from the CPUs since the meter started, from the first two
    fields of Linux's `/proc/<pid>/task/<tid>/schedstat` summed over the threads: time on a CPU and
    run delay (time runnable but waiting for a CPU: the CPU time others took from it). The thread
    list is read again every `rescan_s` (OpenMP starts its workers lazily); a thread counts from when
    the meter first sees it. `available` is False where the kernel gives no schedstat (not Linux, or
    CONFIG_SCHED_INFO off)."""

    def __init__(
        self, task_dir: str = "/proc/self/task", rescan_s: float = 1.0, clock=None
    ) -> None:
        self._task_dir = task_dir
        self._rescan_s = rescan_s
        self._clock = clock or time.monotonic
        self._fds: dict[str, int] = {}
        self._last_ns: dict[str, tuple[int, int]] = {}
        self._cpu_ns = self._delay_ns = 0
        self._scanned_at = float("-inf")
        self.available = self._scan()

    def _times_ns(self, tid: str) -> tuple[int, int] | None:
        try:
            fields = os.pread(self._fds[tid], 128, 0).split()
            return int(fields[0]), int(fields[1])
        except (OSError, IndexError, ValueError):  # the thread ended
            os.close(self._fds.pop(tid))
            self._last_ns.pop(tid, None)
            return None

    def _scan(self) -> bool:
        try:
            tids = set(os.listdir(self._task_dir))
        except OSError:
            return False
        for tid in tids - self._fds.keys():
            try:
                self._fds[tid] = os.open(f"{self._task_dir}/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue
            now = self._times_ns(tid)
            if now is not None:
                self._last_ns[tid] = now
        self._scanned_at = self._clock()
        return bool(self._fds)

    def read(self) -> SchedTimes:
        """Totals since the meter started; they never fall (a thread that ended keeps its share)."""
        if self._clock() - self._scanned_at >= self._rescan_s:
            self._scan()
        for tid in list(self._fds):
            now = self._times_ns(tid)
            if now is not None:
                last = self._last_ns[tid]
                self._cpu_ns += max(0, now[0] - last[0])
                self._delay_ns += max(0, now[1] - last[1])
                self._last_ns[tid] = now
        return SchedTimes(self._cpu_ns * 1e-9, self._delay_ns * 1e-9)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:  # an engine dropped without a shutdown keeps no descriptors open
        with contextlib.suppress(Exception):
            self.close()


def next_thread_count(
    threads: int, lost: float, cores: float, *, threshold: float, margin: float
) -> int:
    """The thread pool's size after a window run on `threads` threads, in which they lost `lost` of
    their thread-seconds to other processes (run delay / (step wall time x threads)) and used `cores`
    CPUs (time on a CPU / step wall time).

    One thread fewer only where both hold: something took CPU time from the pool (`lost >
    threshold`), and the last thread bought less than `margin` of a core (`cores < threads - 1 +
    margin`): `threads - 1` threads could have had as much CPU, without waiting at every barrier for
    the thread the neighbour delays. A quiet machine (no loss) keeps every thread, and so does a pool
    beside a light neighbour (the API process, the load generator) that still gets more than
    `threads - 1` cores."""
    if threads > 1 and lost > threshold and cores < threads - 1 + margin:
        return threads - 1
    return threads


class ThreadPoolSizer:
    """How many threads of the OpenMP thread pool the engine's next step uses, chosen from the CPU
    time its threads get and lose (`next_thread_count`).

    Beside a neighbour that keeps a core busy, a pool with a thread on every core runs each step at
    the pace of the thread the neighbour delays (every layer ends in barriers) and gets about one
    core whatever it does (docs/performance.md "Threads"). The runner reports each step's wall time;
    over a window of steps (`window_s` of step time, at least `min_steps` steps) the sizer reads the
    threads' CPU time and run delay (`RunDelayMeter`) and applies `next_thread_count`. A smaller pool
    cannot see whether the neighbour left, so after `probe_s` it tries one more thread for a window,
    which the same rule keeps or drops; a dropped probe doubles the wait before the next (up to
    `max_probe_s`). The thread count changes the speed, never the numbers: every kernel gives the
    same bits at any thread count (tests/parallel/test_thread_pool_sizer.py).

    `clock` and `meter` are injectable (tests drive the policy with a fake clock and CPU times)."""

    def __init__(
        self,
        max_threads: int,
        meter: RunDelayMeter | None = None,
        *,
        clock=None,
        threshold: float = 0.2,
        margin: float = 0.5,
        window_s: float = 0.2,
        min_steps: int = 3,
        probe_s: float = 1.0,
        max_probe_s: float = 8.0,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.meter = meter if meter is not None else RunDelayMeter()
        self._clock = clock or time.monotonic
        self.threshold, self.margin = threshold, margin
        self.window_s, self.min_steps = window_s, min_steps
        self.min_probe_s, self.max_probe_s = probe_s, max_probe_s
        self._probe_wait_s = probe_s
        self._probing = False
        self._next_probe = float("inf")
        self.last_lost: float | None = None  # the last window's run delay per thread-second
        self.last_cores: float | None = None  # the last window's CPU time per second of steps
        self.num_changes = 0
        self._open_window()

    def _open_window(self) -> None:
        self._window_wall_s, self._window_steps = 0.0, 0
        self._window_start = self.meter.read()

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            self.threads = threads
            self.num_changes += 1

    def observe(self, step_s: float) -> int:
        """Record one step's wall time; returns the thread count for the next step."""
        now = self._clock()
        if not self._probing and self.threads < self.max_threads and now >= self._next_probe:
            self._probing = True  # the window now open measured the smaller pool: start afresh
            self._set(self.threads + 1)
            self._open_window()
            return self.threads
        self._window_wall_s += step_s
        self._window_steps += 1
        if self._window_wall_s < self.window_s or self._window_steps < self.min_steps:
            return self.threads
        times, start, wall_s = self.meter.read(), self._window_start, self._window_wall_s
        lost = (times.delay_s - start.delay_s) / (wall_s * self.threads)
        cores = (times.cpu_s - start.cpu_s) / wall_s
        self.last_lost, self.last_cores = lost, cores
        logger.debug(
            "thread pool of %d lost %.3f, used %.2f cores in %.3f s",
            self.threads,
            lost,
            cores,
            wall_s,
        )
        threads = next_thread_count(
            self.threads, lost, cores, threshold=self.threshold, margin=self.margin
        )
        if threads < self.threads:
            if self._probing:  # the neighbour is still there: wait longer before the next try
                self._probe_wait_s = min(2 * self._probe_wait_s, self.max_probe_s)
            self._set(threads)
            self._next_probe = now + self._probe_wait_s
        elif self._probing:
            self._probe_wait_s = self.min_probe_s
            self._next_probe = (
                now + self._probe_wait_s if self.threads < self.max_threads else float("inf")
            )
        self._probing = False
        self._open_window()
        return self.threads
