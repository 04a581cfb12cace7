"""The serving loop's own per-step timings, kept for the simulator's calibration (docs/simulator.md).

Each iteration of the engine thread records: when it started, how long it slept idle before it
(no work), how long applying queued commands, `engine.step()` and handing the outputs to the HTTP
side took, and what the step computed (per chunk, `chunk_row`: new tokens, cached tokens before them,
what it samples, proposals it verifies) and the threads it ran on. The time
from one iteration's start to the next, less the idle wait, is what a step costs *while serving*:
it includes the HTTP side's share of the interpreter and the cores (also between the timed parts
of an iteration), which an offline calibration of `step()` alone never sees. A bounded ring; read through `GET /debug/steps`.
"""

from __future__ import annotations

import threading
from collections import deque

from kvserve.core.outputs import ScheduledChunk

MAX_STEPS = 50_000
SAMPLES_NOTHING, SAMPLES_FIRST, SAMPLES_LATER = 0, 1, 2


def chunk_row(chunk: ScheduledChunk) -> tuple[int, int, int, int]:
    """(new tokens, start position, what the chunk samples, proposals it verifies). It samples
    the request's first output token (`SAMPLES_FIRST`: the prompt's last chunk), a later one
    (`SAMPLES_LATER`: a decode step, a verification, the last chunk of a recomputation after
    preemption), or nothing (`SAMPLES_NOTHING`: a prompt chunk before the last). A chunk verifying k
    proposals yields 1 to k + 1 tokens, at positions start + n - k .. start + n."""
    if not chunk.sample:
        kind = SAMPLES_NOTHING
    else:
        kind = SAMPLES_LATER if chunk.num_output_tokens else SAMPLES_FIRST
    return (chunk.num_tokens, chunk.start_position, kind, chunk.num_spec_tokens)


class StepLog:
    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self._rows: deque[tuple] = deque(maxlen=max_steps)
        self._lock = threading.Lock()
        self.num_recorded = 0

    def record(
        self,
        t_start_s: float,
        waited_s: float,
        commands_s: float,
        step_s: float,
        deliver_s: float,
        chunks: tuple[tuple[int, int, int, int], ...],
        threads: int = 0,
    ) -> None:
        with self._lock:
            self._rows.append(
                (
                    self.num_recorded,
                    t_start_s,
                    waited_s,
                    commands_s,
                    step_s,
                    deliver_s,
                    chunks,
                    threads,
                )
            )
            self.num_recorded += 1

    def since(self, index: int) -> list[dict]:
        """Rows with sequence number >= index (those still in the ring)."""
        with self._lock:
            rows = [r for r in self._rows if r[0] >= index]
        keys = (
            "index",
            "t_start_s",
            "waited_s",
            "commands_s",
            "step_s",
            "deliver_s",
            "chunks",
            "threads",
        )
        return [dict(zip(keys, r, strict=True)) for r in rows]
