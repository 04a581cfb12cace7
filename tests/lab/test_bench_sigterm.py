"""A benchmark killed with SIGTERM takes its children with it (benchmarks/_report.py,
`stop_children_on_sigterm`): a `kvserve bench serve` child of `subprocess.run` was left running when
`sim_validation.py` was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"

PARENT = """
import subprocess, sys
sys.path.insert(0, {benchmarks!r})
if {handler}:
    from _report import stop_children_on_sigterm
    stop_children_on_sigterm()
child = "import os, time; os.write({fd}, str(os.getpid()).encode()); os.close({fd}); time.sleep(600)"
# the benchmarks' way (sim_validation.py's bench child); the pipe closes when both have exited
subprocess.run([sys.executable, "-c", child], pass_fds=[{fd}])
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_and_terminate(handler: bool) -> tuple[int, int]:
    """(the parent's return code after SIGTERM, its child's pid). The child writes its pid into a
    pipe once it runs; reading it blocks until then (no polling), and if the child fails first,
    both exit and the pipe reads EOF instead."""
    read_fd, write_fd = os.pipe()
    code = PARENT.format(benchmarks=str(BENCHMARKS), handler=handler, fd=write_fd)
    parent = subprocess.Popen([sys.executable, "-c", code], pass_fds=[write_fd])
    os.close(write_fd)
    try:
        pid = os.read(read_fd, 64)  # one write of under PIPE_BUF bytes: read whole
        os.close(read_fd)
        assert pid, "the child never started"
        child = int(pid)
        parent.send_signal(signal.SIGTERM)
        return parent.wait(timeout=60), child
    finally:
        if parent.poll() is None:
            parent.kill()


def test_sigterm_stops_the_child():
    code, child = _run_and_terminate(handler=True)
    assert code == 128 + signal.SIGTERM
    assert not _alive(child)  # subprocess.run killed and reaped it


@pytest.mark.skipif(sys.platform != "linux", reason="checks a process left behind")
def test_without_the_handler_the_child_is_left_behind():
    """The test of the test: Python's default SIGTERM leaves the child running."""
    code, child = _run_and_terminate(handler=False)
    try:
        assert code == -signal.SIGTERM
        assert _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
