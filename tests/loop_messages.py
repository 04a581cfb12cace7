"""Driving a `ServingLoop` (kvserve/engine/serving_loop.py) by hand: an add command, and the loop's
messages up to the one a test waits for (tests/engine/test_serving_loop.py, test_engine_core.py)."""

from __future__ import annotations

import queue
import time

from kvserve import SamplingParams
from kvserve.engine.wire import AddCmd, CoreOutputs

TIMEOUT_S = 60.0


def add_command(request_id: str, prompt: list[int], params: SamplingParams) -> AddCmd:
    return AddCmd(request_id, prompt, params, None, None, time.monotonic())


def messages_until(outputs: queue.SimpleQueue, done) -> list[CoreOutputs]:
    """Messages from the loop until `done(message)` holds for one (bounded in time)."""
    got = []
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        message = outputs.get(timeout=max(0.1, deadline - time.monotonic()))
        got.append(message)
        if done(message):
            return got
