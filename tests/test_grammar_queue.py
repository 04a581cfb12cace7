"""The grammar queue (kvserve/server/grammar_queue.py): one grammar at a time on its own thread, the
smallest waiting constraint next, a request that left skipped, a full queue a 429."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.server.errors import APIError
from kvserve.server.grammar_queue import GrammarQueue


async def _wait_for(condition) -> None:
    while not condition():
        await asyncio.sleep(0)


def test_one_at_a_time_smallest_first_and_leavers_skipped():
    async def main() -> list[int]:
        queue = GrammarQueue()
        release = threading.Event()
        order: list[int] = []
        running: list[int] = []

        def compile_(size: int) -> int:
            running.append(size)
            assert len(running) - len(order) == 1  # never two at once
            if size == 1000:
                release.wait(30)  # the first holds the thread until every other one has queued
            order.append(size)
            return size

        first = asyncio.create_task(queue.run(1000, compile_, 1000))
        await _wait_for(lambda: running)
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


def test_a_full_queue_is_a_429_and_errors_pass_the_turn_on():
    async def main() -> None:
        queue = GrammarQueue(max_waiting=2)
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
