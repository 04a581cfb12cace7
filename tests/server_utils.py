"""Start `kvserve serve` as a real process on 127.0.0.1 and wait until it is ready.

The engine core runs in its own process (the default) unless `KVSERVE_TEST_ENGINE_CORE=in-process`
(the CI runs the server tests both ways; see tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_core_mode() -> str:
    return os.environ.get("KVSERVE_TEST_ENGINE_CORE", "process")


def engine_core_args() -> tuple[str, ...]:
    return ("--engine-core", engine_core_mode())


def serve_command(model_dir: str | Path, port: int, *args: str) -> list[str]:
    """`kvserve serve MODEL` on 127.0.0.1:`port` through this interpreter, then `args`."""
    return [sys.executable, "-m", "kvserve.cli", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), *args]  # fmt: skip


@contextlib.contextmanager
def running_server(
    model_dir: str | Path,
    *args: str,
    timeout_s: float = 180.0,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
):
    """Yields (base_url, process) once the server says it is ready (`--ready-fd`). Stops it with
    SIGTERM, then SIGKILL if it lingers. `env`: the server's whole environment (default: this
    process's)."""
    port = free_port()
    cmd = serve_command(model_dir, port, "--log-level", "warning", *engine_core_args(), *args)
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    env = {**(os.environ if env is None else env), "TOKENIZERS_PARALLELISM": "false"}
    with ReadyPipe() as ready:
        cmd += ["--ready-fd", str(ready.write_fd)]
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(ready.write_fd,)
        )
        ready.handed_over()
        base_url = f"http://127.0.0.1:{port}"
        try:
            line = ready.line(timeout_s)
            if line != f"ready {base_url}":
                detail = f"{process.returncode}" if process.poll() is not None else "running"
                raise RuntimeError(
                    f"server not ready ({line!r}, process {detail}): {' '.join(cmd)}"
                )
            yield base_url, process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if log_path:
                log.close()


class ReadyPipe:
    """A pipe for `kvserve serve --ready-fd`: pass `write_fd` to the server (`pass_fds`), then call
    `handed_over()` to close this process's copy, so that the server holds the only write end and its
    exit reads as end of file; `line(timeout_s)` is the line it writes. Each end is closed exactly once:
    a number closed twice may by then belong to another thread (an in-thread server's event loop)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self._open = {self.read_fd, self.write_fd}

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            os.close(fd)

    def handed_over(self) -> None:
        self._close(self.write_fd)

    def line(self, timeout_s: float) -> str:
        """`ready URL` or `failed: REASON`; "" when the server exited first (end of file). Blocks in
        select() until data, end of file or the deadline (then a TimeoutError)."""
        data = b""
        deadline = time.monotonic() + timeout_s
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError(f"server not ready after {timeout_s} s")
            chunk = os.read(self.read_fd, 4096)
            if not chunk:
                break  # end of file: the server exited (or closed it) without a line
            data += chunk
        return data.decode().strip()

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            self._close(fd)

    def __enter__(self) -> ReadyPipe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NotifyingServer(uvicorn.Server):
    """uvicorn's server that sets `listening` once its sockets accept connections, so a test that runs
    it in a thread waits on that event instead of polling the port."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = threading.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:  # a failed bind sets should_exit (or exits the thread)
            self.listening.set()

    def start_in_thread(self, timeout_s: float = 10.0, **run_kwargs) -> threading.Thread:
        """server.run(**run_kwargs) in a daemon thread, returned once it listens (else an error)."""
        thread = threading.Thread(target=self.run, kwargs=run_kwargs, daemon=True)
        thread.start()
        if not self.listening.wait(timeout_s):
            raise RuntimeError(f"server did not start listening within {timeout_s} s")
        return thread


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a streamed response, checking the framing (`data: ...` + blank line)."""
    raw = response.read().decode() if not hasattr(response, "_content") else response.text
    assert raw.endswith("\n\n"), "an SSE stream must end with a blank line"
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"bad SSE event {block[:80]!r}"
        events.append(block[len("data: ") :])
    return events


@pytest.fixture(scope="module", autouse=True)
def engine_core_in_process():
    """Imported by a test module, it runs that module's servers with `--engine-core in-process`
    (autouse and module-scoped, so it is set before the module's server fixtures start)."""
    previous = os.environ.get("KVSERVE_TEST_ENGINE_CORE")
    os.environ["KVSERVE_TEST_ENGINE_CORE"] = "in-process"
    yield
    if previous is None:
        os.environ.pop("KVSERVE_TEST_ENGINE_CORE", None)
    else:
        os.environ["KVSERVE_TEST_ENGINE_CORE"] = previous
