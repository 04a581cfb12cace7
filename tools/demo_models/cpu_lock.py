"""Share the machine's CPU with the tests and benchmarks of other users, one training step at a time.

The protocol of the machine's `kv-test` and `kv-bench` wrappers: a test takes /tmp/kv-gate exclusively
for an instant (it waits while a benchmark is queued), then holds /tmp/kv-cpu shared; a benchmark holds
/tmp/kv-gate while it waits for /tmp/kv-cpu exclusively. A training loop that takes its turn like a
test before every step therefore stops within one step when a benchmark asks for the machine, and
resumes when the benchmark ends.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

GATE_PATH = Path("/tmp/kv-gate")
CPU_PATH = Path("/tmp/kv-cpu")


def _open_lock(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


class CpuTurn:
    """`with turn:` holds the shared CPU lock for one step (no-op when disabled). `waited_s` sums
    the seconds spent waiting for benchmarks."""

    def __init__(
        self, enabled: bool, gate_path: Path = GATE_PATH, cpu_path: Path = CPU_PATH
    ) -> None:
        self.enabled, self.gate_path, self.cpu_path = enabled, gate_path, cpu_path
        self.waited_s = 0.0
        self._cpu_fd: int | None = None

    def __enter__(self) -> CpuTurn:
        if not self.enabled:
            return self
        start = time.perf_counter()
        gate = _open_lock(self.gate_path)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)  # waits while a benchmark is queued or running
            fcntl.flock(gate, fcntl.LOCK_UN)
        finally:
            os.close(gate)
        self._cpu_fd = _open_lock(self.cpu_path)
        fcntl.flock(self._cpu_fd, fcntl.LOCK_SH)
        self.waited_s += time.perf_counter() - start
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._cpu_fd is not None:
            fcntl.flock(self._cpu_fd, fcntl.LOCK_UN)
            os.close(self._cpu_fd)
            self._cpu_fd = None
