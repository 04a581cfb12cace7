"""`kvserve serve --ready-fd FD`: one line once the server listens with its model warmed up (`ready URL`),
`failed: REASON` when the load fails (the process stays up, /ready says why), end of file when the process
exits first; a descriptor that is not open is refused before any work. Every other server test waits on the
same line (tests/server_utils.running_server)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import httpx
import pytest

from tests.server_utils import ReadyPipe, free_port, running_server, serve_command

pytestmark = pytest.mark.slow

SMALL = ("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--engine-core", "in-process")


def _serve(model_dir, ready: ReadyPipe, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = serve_command(model_dir, port, "--log-level", "warning", "--ready-fd", str(ready.write_fd),
                        *args)  # fmt: skip
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(ready.write_fd,), text=True
    )
    ready.handed_over()
    return process, f"http://127.0.0.1:{port}"


def _stop(process: subprocess.Popen) -> str:
    if process.poll() is None:
        process.terminate()
    out, _ = process.communicate(timeout=60)
    return out


def test_ready_line_names_the_url_and_ready_answers_at_once(gpt2_model_dir):
    with running_server(gpt2_model_dir, *SMALL) as (url, _):  # it read "ready URL"
        # no polling: the line comes after the load, so the first probe is already 200
        assert httpx.get(f"{url}/ready").status_code == 200


def test_a_failed_load_says_failed_and_exits_non_zero(gpt2_model_dir, tmp_path):
    """issue 45: a server whose model failed to load kept answering /health 200 until killed. Now
    it writes the failed line, exits 1 and says why on one stderr line."""
    broken = tmp_path / "broken"
    shutil.copytree(gpt2_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with ReadyPipe() as ready:
        process, _ = _serve(broken, ready, *SMALL)
        try:
            line = ready.line(180)
            assert line.startswith("failed: "), line
            assert "\n" not in line
            out, _ = process.communicate(timeout=60)
            assert process.returncode == 1
            errors = [x for x in out.splitlines() if x.startswith("kvserve serve: error: ")]
            assert len(errors) == 1, out[-3000:]
            assert line.removeprefix("failed: ") in errors[0]
        finally:
            _stop(process)


def test_end_of_file_when_the_server_exits_first(gpt2_model_dir):
    with ReadyPipe() as ready:
        # the port is taken: uvicorn cannot bind and the process exits before it could be ready
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            process, _ = _serve(gpt2_model_dir, ready, *SMALL, "--port", str(port))
            try:
                assert ready.line(180) == ""
                assert process.wait(timeout=60) != 0
            finally:
                _stop(process)


def test_a_descriptor_that_is_not_open_is_refused(gpt2_model_dir):
    fd = 987  # far above what a new Python process has open
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", str(gpt2_model_dir), "--ready-fd", str(fd)],
        capture_output=True, text=True, timeout=120, close_fds=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"--ready-fd {fd} is not an open file descriptor" in result.stderr


def test_a_standard_stream_is_refused(gpt2_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", str(gpt2_model_dir), "--ready-fd", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--ready-fd 1 is a standard stream" in result.stderr
