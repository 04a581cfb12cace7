"""A benchmark killed with SIGTERM takes its children with it (benchmarks/_report.py,
`stop_children_on_sigterm`): a `kvserve bench serve` child of `subprocess.run` was left running when
`sim_validation.py` was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

PARENT = """
import subprocess, sys
sys.path.insert(0, {benchmarks!r})
if {handler}:
    from _report import stop_children_on_sigterm
    stop_children_on_sigterm()
child = "import os, pathlib, time; pathlib.Path({pidfile!r}).write_text(str(os.getpid())); time.sleep(600)"
subprocess.run([sys.executable, "-c", child])
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_and_terminate(tmp_path: Path, handler: bool) -> tuple[int, int]:
    """(the parent's return code after SIGTERM, its child's pid)"""
    pidfile = tmp_path / "child.pid"
    code = PARENT.format(benchmarks=str(BENCHMARKS), handler=handler, pidfile=str(pidfile))
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()):  # the child is running
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        child = int(pidfile.read_text())
        parent.send_signal(signal.SIGTERM)
        return parent.wait(timeout=60), child
    finally:
        if parent.poll() is None:
            parent.kill()


def test_sigterm_stops_the_child(tmp_path):
    code, child = _run_and_terminate(tmp_path, handler=True)
    assert code == 128 + signal.SIGTERM
    assert not _alive(child)  # subprocess.run killed and reaped it


@pytest.mark.skipif(sys.platform != "linux", reason="checks a process left behind")
def test_without_the_handler_the_child_is_left_behind(tmp_path):
    """The test of the test: Python's default SIGTERM leaves the child running."""
    code, child = _run_and_terminate(tmp_path, handler=False)
    try:
        assert code == -signal.SIGTERM
        assert _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
