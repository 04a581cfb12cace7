"""Tensor parallelism across hosts (kvserve/runner/nodes.py, node_agent.py, multinode.py;
docs/parallel.md "Across hosts").

The hosts are two network namespaces joined by a veth pair (tests/netns.py): node 0 runs `kvserve
generate` in one, node 1 `kvserve tp-node` in the other, and gloo's collectives cross the veth.
Oracle: the same engine at TP = 1 in this process (greedy token ids must be equal). Where namespaces
cannot be created (not root) those tests skip with the reason; the failure and authentication tests
that need no second host run on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvserve.links import (
    SECRET_ENV,
    AuthenticationError,
    client_handshake,
    server_handshake,
)
from tests import REPO_ROOT
from tests.checkpoints import build_gpt2_tokenized_checkpoint
from tests.faults import FaultGate
from tests.netns import NetnsUnavailable, two_hosts

pytestmark = pytest.mark.slow

SECRET = "multihost-test-secret-0123456789"
RUN_TIMEOUT_S = 90  # every subprocess; the test fails rather than hang
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time"]
ENGINE = ["--num-blocks", "256", "--block-size", "16", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (4 heads, 2 KV heads: splits two ways) over GPT-2's tokenizer."""
    path = tmp_path_factory.mktemp("multihost") / "llama"
    build_gpt2_tokenized_checkpoint(
        path,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=4096,
    )
    return path


@pytest.fixture(scope="module")
def hosts():
    try:
        with two_hosts() as pair:
            yield pair
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")


def _env(secret: str = SECRET) -> dict:
    root = str(REPO_ROOT)
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        SECRET_ENV: secret,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": root + (os.pathsep + path if path else ""),
    }


def _kvserve(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvserve", *argv]


def _layout(addr: str, node_rank: int, timeout_s: float = 30) -> list[str]:
    return ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(node_rank),
            "--dist-init-addr", addr, "--dist-timeout", str(timeout_s)]  # fmt: skip


def _start(argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: killed whole on failure
    )  # fmt: skip


def _finish(process: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(process)
        out, err = process.communicate()
        pytest.fail(f"{process.args[-12:]} did not end within {timeout_s} s:\n{err[-3000:]}")


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _generate_argv(model_dir: Path, max_tokens: int, prompts=PROMPTS) -> list[str]:
    argv = ["generate", "--model", str(model_dir), *ENGINE, "--max-tokens", str(max_tokens)]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    return [*argv, "--json", "--ignore-eos"]


def _tp1_token_ids(model_dir: Path, max_tokens: int) -> list[list[int]]:
    from kvserve import LLM, SamplingParams

    llm = LLM(str(model_dir), num_blocks=256, block_size=16, max_model_len=1024)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_tp2_across_two_namespaces_equals_tp1(model_dir, hosts):
    node0, node1 = hosts
    addr = f"{node0.address}:29517"
    env = _env()
    follower = _start(node1.command(*_kvserve("tp-node", str(model_dir), *ENGINE,
                                             *_layout(addr, 1))), env)  # fmt: skip
    try:
        leader = _start(
            node0.command(*_kvserve(*_generate_argv(model_dir, 24), *_layout(addr, 0))), env
        )
        out, err = _finish(leader)
        assert leader.returncode == 0, err[-3000:]
        _, follower_err = _finish(follower)
    finally:
        _kill(follower)
    assert follower.returncode == 0, follower_err[-3000:]
    assert "rank 1 loaded" in follower_err
    got = [json.loads(line)["token_ids"] for line in out.splitlines()]
    assert got == _tp1_token_ids(model_dir, 24)


def test_a_node_that_never_arrives_ends_the_engine(model_dir):
    """No node 1: generate fails with one line naming the missing node and the timeout."""
    port = _free_port()
    argv = _kvserve(*_generate_argv(model_dir, 4), *_layout(f"127.0.0.1:{port}", 0, 3))
    process = _start(argv, _env())
    _, err = _finish(process, 60)
    assert process.returncode == 1
    assert f"node(s) 1 of 2 did not join 127.0.0.1:{port} within 3 s" in _error_line(err)


def test_a_node_killed_mid_run_ends_the_engine(model_dir, hosts):
    """Node 1 (its agent and its rank) killed during decoding: node 0 ends with one line naming
    node 1, within the subprocess bound (gloo sees the closed sockets at once). Node 0's steps pass
    the test's gate (tests/faults.py), so the kill lands between two decode steps, not after a
    guessed delay."""
    node0, node1 = hosts
    addr = f"{node0.address}:29519"
    env = _env()
    follower = _start(node1.command(*_kvserve("tp-node", str(model_dir), *ENGINE,
                                             *_layout(addr, 1))), env)  # fmt: skip
    with FaultGate() as steps:
        leader = _start(node0.command(*_kvserve(*_generate_argv(model_dir, 1000, PROMPTS * 4),
                                                *_layout(addr, 0), "--inject-fault",
                                                steps.spec())), env)  # fmt: skip
        try:
            steps.hold()  # what node 0's engine is told when it connects
            steps.wait_for_cores(1, 120)  # node 0's engine is up (both ranks loaded)
            steps.wait_held(1)  # before its first step, with the prompts in it
            steps.step(2)  # the prompt step and a decode step, then held again
            steps.wait_passed(2)
            _kill(follower)
            steps.open()  # the next decode step meets the dead node
            out, err = _finish(leader, 60)
        finally:
            _kill(follower)
            _kill(leader)
    assert leader.returncode == 1, err[-3000:]
    assert out == ""  # no request finished
    line = _error_line(err)
    assert line.startswith("kvserve generate: error: tensor-parallel node 1 (10.77.0.2"), line


def test_handshake_refuses_a_wrong_secret_and_a_tampered_frame():
    for client_secret, ok in (
        (b"right-secret-0123456789", True),
        (b"wrong-secret-0123456789", False),
    ):
        server_sock, client_sock = socket.socketpair()
        results = {}

        def serve(sock=server_sock, results=results) -> None:
            try:
                results["server"] = server_handshake(sock, b"right-secret-0123456789")
            except AuthenticationError as exc:
                results["server"] = exc
                sock.close()  # as NodeGroup does: the peer sees the refusal as a closed socket

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            client = client_handshake(client_sock, client_secret)
        except AuthenticationError as exc:
            client = exc
        thread.join(10)
        if ok:
            server = results["server"]
            client.send(["hello", 1, {}])
            assert server.recv(timeout_s=5) == ["hello", 1, {}]
            # a frame altered on the wire fails its tag
            client_sock.sendall(b"\x02\x00\x00\x00[]" + b"\x00" * 32)
            with pytest.raises(AuthenticationError):
                server.recv(timeout_s=5)
        else:
            assert isinstance(results["server"], AuthenticationError)
            assert isinstance(client, AuthenticationError)
            assert "refused this node's secret" in str(client)


def test_unauthenticated_peers_are_refused_and_the_right_node_still_joins(model_dir):
    """Node 0 on loopback: a peer with a wrong secret and one that sends garbage are refused
    (they read only the challenge, never the store's address); then node 1 joins and the run ends."""
    addr, port = "127.0.0.1", _free_port()
    leader = _start(_kvserve(*_generate_argv(model_dir, 4), *_layout(f"{addr}:{port}", 0)), _env())
    follower = None
    try:
        sock = _connect(addr, port, 60, leader)
        with pytest.raises(AuthenticationError, match="refused this node's secret"):
            client_handshake(sock, b"not-the-secret-0123456789")
        sock.close()
        raw = _connect(addr, port, 10, leader)
        challenge = raw.recv(4096)
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
        rest = _read_all(raw)
        assert challenge.startswith(b"KVSERVE-TP/1\n") and rest == b""  # closed, nothing told
        follower = _start(_kvserve("tp-node", str(model_dir), *ENGINE,
                                   *_layout(f"{addr}:{port}", 1)), _env())  # fmt: skip
        out, err = _finish(leader)
        assert leader.returncode == 0, err[-3000:]
        assert len(out.splitlines()) == len(PROMPTS)
        _finish(follower)
        assert follower.returncode == 0
    finally:
        _kill(leader)
        if follower is not None:
            _kill(follower)


def test_a_node_with_the_wrong_secret_cannot_join(model_dir):
    addr = f"127.0.0.1:{_free_port()}"
    leader = _start(_kvserve(*_generate_argv(model_dir, 4), *_layout(addr, 0, 8)), _env())
    follower = _start(
        _kvserve("tp-node", str(model_dir), *ENGINE, *_layout(addr, 1, 8)),
        _env("another-secret-0123456789"),
    )
    try:
        _, follower_err = _finish(follower, 60)
        _, leader_err = _finish(leader, 60)
    finally:
        _kill(leader)
        _kill(follower)
    assert follower.returncode == 1
    assert "refused this node's secret" in _error_line(follower_err, "tp-node")
    assert leader.returncode == 1
    assert "did not join" in _error_line(leader_err)


def _error_line(stderr: str, command: str = "generate") -> str:
    """The one line the command printed for its error (torch may log after it at exit)."""
    lines = [line for line in stderr.splitlines() if line.startswith(f"kvserve {command}: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _connect(host: str, port: int, timeout_s: float, process) -> socket.socket:
    """A connection to the rendezvous port `process` (node 0) opens once it has loaded; nothing
    announces that, so this retries, and gives up at once if the process has exited instead."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except OSError:
            if process.poll() is not None:
                raise AssertionError(f"node 0 exited ({process.returncode}) first") from None
            if time.monotonic() > deadline:
                raise
            try:  # the retry interval, cut short if node 0 exits meanwhile
                process.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data
