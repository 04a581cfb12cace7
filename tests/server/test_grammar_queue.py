"""The grammar queue (kvserve/server/grammar_queue.py): one grammar at a time on its own thread, the
smallest waiting constraint next (aged by arrival), a request that left skipped, a full queue a 429."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.server.errors import APIError
from kvserve.server.grammar_queue import AGEING_S_PER_BYTE, GrammarQueue


async def _wait_for(condition) -> None:
    for _ in range(1_000_000):  # event-loop turns, not time: a regression fails instead of hanging
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def _queue(now: list[float], **kwargs) -> GrammarQueue:
    return GrammarQueue(clock=lambda: now[0], **kwargs)


def _held_compiler(holder):
    """(release, ran, compile): `compile(name)` records `name` in `ran` and returns it; the call for
    `holder` first blocks the grammar thread until `release` is set."""
    release = threading.Event()
    ran: list = []

    def compile_(name):
        if name == holder:
            release.wait(30)
        ran.append(name)
        return name

    return release, ran, compile_


def test_one_at_a_time_smallest_first_and_leavers_skipped():
    async def main() -> list[int]:
        queue = _queue([0.0])
        # the first holds the thread until every other one has queued
        release, order, compile_ = _held_compiler(1000)
        first = asyncio.create_task(queue.run(1000, compile_, 1000))
        await _wait_for(lambda: queue._busy)
        tasks = {
            size: asyncio.create_task(queue.run(size, compile_, size)) for size in (50, 7, 30, 9)
        }
        await _wait_for(lambda: queue.num_waiting == 4)
        tasks[9].cancel()  # the client left while its grammar waited
        await _wait_for(lambda: queue.num_waiting == 3)
        release.set()
        assert await first == 1000
        results = await asyncio.gather(*(tasks[s] for s in (50, 7, 30)))
        with pytest.raises(asyncio.CancelledError):
            await tasks[9]
        assert results == [50, 7, 30]
        assert not queue._busy and not queue._waiting
        return order

    assert asyncio.run(main()) == [1000, 7, 30, 50]


def test_a_large_grammar_is_aged_past_newer_small_ones():
    """A 500 KB constraint lets newer small ones pass for 50 s of arrival time, then goes first."""

    async def main() -> list[str]:
        now = [0.0]
        queue = _queue(now)
        release, order, compile_ = _held_compiler("running")
        running = asyncio.create_task(queue.run(10, compile_, "running"))
        await _wait_for(lambda: queue._busy)
        big = asyncio.create_task(queue.run(500_000, compile_, "big"))
        await _wait_for(lambda: queue.num_waiting == 1)
        now[0] = 500_000 * AGEING_S_PER_BYTE - 1  # 49 s later: a small one still passes it
        early = asyncio.create_task(queue.run(10, compile_, "small early"))
        await _wait_for(lambda: queue.num_waiting == 2)
        now[0] = 500_000 * AGEING_S_PER_BYTE + 1  # 51 s: the big one has aged past a new small one
        late = asyncio.create_task(queue.run(10, compile_, "small late"))
        await _wait_for(lambda: queue.num_waiting == 3)
        release.set()
        await asyncio.gather(running, big, early, late)
        return order

    assert asyncio.run(main()) == ["running", "small early", "big", "small late"]


def test_the_holder_leaving_mid_compile_or_after_its_wake_up_passes_the_turn_on():
    async def main() -> None:
        queue = _queue([0.0])
        release, ran, compile_ = _held_compiler("holder")
        holder = asyncio.create_task(queue.run(1, compile_, "holder"))
        await _wait_for(lambda: queue._busy)
        woken = asyncio.create_task(queue.run(2, compile_, "woken, then leaves"))
        last = asyncio.create_task(queue.run(3, compile_, "last"))
        await _wait_for(lambda: queue.num_waiting == 2)
        holder.cancel()  # its client left while its grammar compiled: the turn moves on at once
        with pytest.raises(asyncio.CancelledError):
            await holder
        woken.cancel()  # woken by the hand-on, cancelled before it resumed: it passes the turn on
        with pytest.raises(asyncio.CancelledError):
            await woken
        release.set()  # the abandoned compile ends; the single thread then runs the last one
        await last
        assert ran == ["holder", "last"] and not queue._busy

    asyncio.run(main())


def test_a_full_queue_is_a_429_and_errors_pass_the_turn_on():
    async def main() -> None:
        queue = _queue([0.0], max_waiting=2)
        release = threading.Event()

        def slow() -> None:
            release.wait(30)

        def fails() -> None:
            raise ValueError("bad grammar")

        first = asyncio.create_task(queue.run(5, slow))
        await _wait_for(lambda: queue._busy)
        waiting = [
            asyncio.create_task(queue.run(1, fails)),
            asyncio.create_task(queue.run(2, slow)),
        ]
        await _wait_for(lambda: queue.num_waiting == 2)
        with pytest.raises(APIError) as info:
            await queue.run(3, slow)
        assert info.value.status_code == 429 and info.value.code == "grammar_queue_full"
        release.set()
        await first
        with pytest.raises(ValueError, match="bad grammar"):
            await waiting[0]
        await waiting[1]  # the failure handed the turn on
        assert not queue._busy

    asyncio.run(main())
