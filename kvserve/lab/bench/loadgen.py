"""The asyncio load driver: sends at scheduled absolute times (open loop) or per user (closed loop).

Send times are `origin + LEAD_S + offset` on the monotonic clock, so lateness never accumulates the
way relative sleeps drift; how late each send was is the schedule lag. A monitor task measures the
event loop's own lag (the load generator as a bottleneck, docs/load-tests.md). The first Ctrl-C stops
sending, cancels what is in flight and returns everything measured so far; a second one aborts.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvserve.lab.bench.records import RequestRecord, RequestSpec

LEAD_S = 0.05  # the first send is this far after the origin, so set-up never makes it late
LAG_INTERVAL_S = 0.01

# send(spec, request_id, phase, t_scheduled_s, origin_s, sink) -> (record, text); see
# client.send_request
SendFn = Callable[
    [RequestSpec, str, str, float, float, dict[str, tuple[RequestRecord, str]]],
    Awaitable[tuple[RequestRecord, str]],
]


@dataclass(frozen=True)
class LoadPlan:
    """Warm-up requests first, then measured ones. `offsets_s` None means a closed loop of
    `max_concurrency` users; otherwise `max_concurrency` is an optional client-side cap."""

    requests: tuple[RequestSpec, ...]
    num_warmup: int
    offsets_s: tuple[float, ...] | None
    max_concurrency: int | None = None
    duration_s: float | None = None  # closed loop: no new measured request after this

    def __post_init__(self) -> None:
        if self.offsets_s is not None and len(self.offsets_s) != len(self.requests):
            raise ValueError("one offset per request")
        if self.offsets_s is None and not self.max_concurrency:
            raise ValueError("a closed loop needs max_concurrency")

    def phase(self, position: int) -> str:
        return "warmup" if position < self.num_warmup else "measured"


@dataclass(frozen=True)
class LoadResult:
    """Records in plan order (requests never sent because of an interruption are absent) and their
    texts."""

    records: tuple[RequestRecord, ...]
    texts: tuple[str, ...]
    origin_epoch_s: float  # time.time() at the run clock's zero
    wall_s: float
    cpu_s: float  # this process's CPU time over the run
    loop_lag_s: tuple[float, ...]
    interrupted: bool


def request_id(position: int) -> str:
    return f"req-{position:06d}"


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.sent = self.done = self.not_ok = 0

    def show(self, elapsed_s: float, final: bool = False) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        line = (
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
            f"{self.sent - self.done} in flight, {self.not_ok} not ok, {elapsed_s:6.1f} s"
        )
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()


async def run_load(plan: LoadPlan, send: SendFn, progress: bool = False) -> LoadResult:
    """Long: the load loop with its arrival schedule, cancellation and clean-up in one place, so a stop
    signal is handled once."""
    loop = asyncio.get_running_loop()
    clock = time.perf_counter
    origin, epoch, cpu0 = clock(), time.time(), time.process_time()
    sink: dict[str, tuple[RequestRecord, str]] = {}
    lags: list[float] = []
    prog = _Progress(len(plan.requests), progress)
    in_flight: set[asyncio.Task] = set()
    interrupted = False

    dispatched: dict[
        int, float
    ] = {}  # position -> scheduled time, for requests cancelled before sending

    async def one(pos: int, t_sched: float, sem: asyncio.Semaphore | None) -> None:
        spec = plan.requests[pos]
        dispatched[pos] = t_sched
        prog.sent += 1
        try:
            if sem is None:
                rec, _ = await send(spec, request_id(pos), plan.phase(pos), t_sched, origin, sink)
            else:
                async with sem:
                    rec, _ = await send(
                        spec, request_id(pos), plan.phase(pos), t_sched, origin, sink
                    )
        finally:
            prog.done += 1
        prog.not_ok += rec.outcome != "ok"

    async def open_loop() -> None:
        sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
        for pos, offset in enumerate(plan.offsets_s):
            target = origin + LEAD_S + offset
            delay = target - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(pos, target - origin, sem))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.wait(set(in_flight))

    async def closed_loop() -> None:
        positions = itertools.count()
        measured_start: list[float] = []
        await asyncio.sleep(max(0.0, origin + LEAD_S - clock()))

        async def user() -> None:
            while (pos := next(positions)) < len(plan.requests):
                now = clock()
                if pos >= plan.num_warmup:
                    if not measured_start:
                        measured_start.append(now)
                    elif plan.duration_s is not None and now - measured_start[0] >= plan.duration_s:
                        return
                await one(pos, now - origin, None)

        await asyncio.gather(*(user() for _ in range(plan.max_concurrency)))

    async def monitor() -> None:
        while True:
            t = clock()
            await asyncio.sleep(LAG_INTERVAL_S)
            lags.append(max(0.0, clock() - t - LAG_INTERVAL_S))
            if prog.enabled and len(lags) % 25 == 0:
                prog.show(clock() - origin)

    driver = asyncio.create_task(open_loop() if plan.offsets_s is not None else closed_loop())
    watcher = asyncio.create_task(monitor())

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        sys.stderr.write(
            "\ninterrupted: stopping; writing what was measured (Ctrl-C again aborts)\n"
        )
        loop.remove_signal_handler(signal.SIGINT)
        driver.cancel()
        for task in list(in_flight):
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        handler_installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
        handler_installed = False
    try:
        await driver
    except asyncio.CancelledError:
        if not interrupted:
            raise
        if in_flight:
            await asyncio.wait(set(in_flight))
    finally:
        watcher.cancel()
        if handler_installed and not interrupted:
            loop.remove_signal_handler(signal.SIGINT)
    wall = clock() - origin
    prog.show(wall, final=True)
    records, texts = [], []
    for pos in range(len(plan.requests)):
        got = sink.get(request_id(pos))
        if got is None and pos in dispatched:  # cancelled while waiting for a concurrency slot
            got = (_never_sent(plan, pos, dispatched[pos], wall), "")
        if got is not None:
            records.append(got[0])
            texts.append(got[1])
    return LoadResult(
        records=tuple(records),
        texts=tuple(texts),
        origin_epoch_s=epoch,
        wall_s=wall,
        cpu_s=time.process_time() - cpu0,
        loop_lag_s=tuple(lags),
        interrupted=interrupted,
    )


def _never_sent(plan: LoadPlan, pos: int, t_scheduled_s: float, t_end_s: float) -> RequestRecord:
    spec = plan.requests[pos]
    return RequestRecord(
        request_id=request_id(pos),
        index=spec.index,
        phase=plan.phase(pos),
        outcome="cancelled",
        t_scheduled_s=t_scheduled_s,
        t_send_s=None,
        t_end_s=t_end_s,
        max_tokens=spec.max_tokens,
        num_prompt_tokens_client=spec.num_prompt_tokens,
        error="cancelled before it was sent (interrupted)",
        prompt_sha256=spec.prompt_sha256,
    )
