"""Engine cores on other hosts (kvserve/engine/remote.py, core_server.py; docs/parallel.md "Engine cores
on other hosts").

Three hosts are network namespaces on one bridge (tests/netns.py): `kvserve serve` in A routes to two
`kvserve engine-core`s in B and C over TCP, and this test's HTTP client runs in A too (threads that
entered A's namespace). Oracle: the same model in this process (greedy completions must be equal).
Where namespaces cannot be created (not root) those tests skip with the reason; the loopback test and
the handshake test need no namespaces.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from kvserve.engine.remote import CORE_MAGIC
from kvserve.engine.wire import CoreOutputs, FromCore
from kvserve.links import (
    SECRET_ENV,
    AuthenticationError,
    client_handshake,
    server_handshake,
)
from tests import REPO_ROOT
from tests.faults import FaultGate
from tests.netns import NetnsUnavailable, hosts
from tests.server_utils import free_port, wait_until

pytestmark = pytest.mark.slow

SECRET = "remote-cores-test-secret-0123456789"
CORE_PORT = 29600
HEARTBEAT_TIMEOUT_S = 5.0
START_TIMEOUT_S = 240  # three processes loading on a busy 2-core machine
ENGINE = ("--max-model-len", "256", "--num-blocks", "256", "--block-size", "16")
PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(20 + 3 * i)] for i in range(8)]


def _env(secret: str = SECRET) -> dict:
    root = str(REPO_ROOT)
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        SECRET_ENV: secret,
        "OMP_NUM_THREADS": "1",
        "KVSERVE_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        "PYTHONPATH": root + (os.pathsep + path if path else ""),
    }


def _start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: killed whole, its engine core included
    )  # fmt: skip


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)


def _kvserve(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvserve", *argv]


def _http() -> httpx.Client:
    return httpx.Client(timeout=120, trust_env=False)  # no proxy from the environment


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with _http() as http:
        response = http.post(f"{url}/v1/completions", json=body)
    return response.status_code, response.json()


def _get(url: str, path: str) -> httpx.Response:
    with _http() as http:
        return http.get(f"{url}{path}")


def _expected(model_dir: Path, prompts, max_tokens: int) -> list[str]:
    from kvserve import LLM, SamplingParams

    llm = LLM(str(model_dir), max_model_len=256, num_blocks=256, block_size=16)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


class Cluster:
    """The API server on host A, engine cores on B and C (indices 0 and 1), all started and ready."""

    def __init__(self, model_dir: Path, trio, logs: Path, gate: FaultGate) -> None:
        self.api, self.b, self.c = trio
        self.gate = gate  # the cores' steps: held by the tests that kill a core mid-request
        self.url = f"http://{self.api.address}:8000"
        self.logs = logs
        self.cores = []
        for host in (self.b, self.c):
            argv = _kvserve("engine-core", str(model_dir), "--host", host.address,
                            "--port", str(CORE_PORT), *ENGINE, "--inject-fault", gate.spec())  # fmt: skip
            self.cores.append(_start(host.command(*argv), logs / f"{host.address}.log", _env()))
        remote = [f"--remote-engine-core={h.address}:{CORE_PORT}" for h in (self.b, self.c)]
        argv = _kvserve("serve", str(model_dir), "--host", self.api.address, "--port", "8000",
                        *ENGINE, *remote)  # fmt: skip
        self.server = _start(self.api.command(*argv), logs / "api.log", _env())
        self.pool = self.api.executor(16)  # the client lives on host A

    def run(self, fn, *args):
        return self.pool.submit(fn, *args).result()

    def ready(self) -> bool:
        try:
            return self.run(_get, self.url, "/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def engines(self) -> list[dict]:
        return self.run(_get, self.url, "/ready").json()["engines"]

    def log(self, name: str = "api.log") -> str:
        return (self.logs / name).read_text()[-4000:]

    def stop(self) -> None:
        for process in (self.server, *self.cores):
            _kill(process)
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def trio():
    try:
        with hosts(3) as three:
            yield three
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")


@pytest.fixture(scope="module")
def gate():
    with FaultGate() as gate:  # a Unix socket: the cores in their namespaces reach it
        yield gate


@pytest.fixture(scope="module")
def cluster(gpt2_model_dir, trio, tmp_path_factory, gate):
    cluster = Cluster(gpt2_model_dir, trio, tmp_path_factory.mktemp("remote-cores"), gate)
    try:
        if not wait_until(cluster.ready, timeout_s=START_TIMEOUT_S, interval_s=0.5):
            pytest.fail(f"the API server did not get ready:\n{cluster.log()}")
        yield cluster
    finally:
        cluster.stop()


def test_requests_spread_over_both_remote_cores_with_one_engines_output(cluster, gpt2_model_dir):
    prompts = PROMPTS[:6]
    futures = [cluster.pool.submit(_complete, cluster.url, p) for p in prompts]
    results = [f.result(timeout=180) for f in futures]
    assert all(status == 200 for status, _ in results), results
    assert [body["choices"][0]["text"] for _, body in results] == _expected(
        gpt2_model_dir, prompts, 8
    )
    engines = cluster.engines()
    assert [e["address"] for e in engines] == [f"{cluster.b.address}:{CORE_PORT}",
                                               f"{cluster.c.address}:{CORE_PORT}"]  # fmt: skip
    assert all(e["alive"] for e in engines)
    assert all(e["num_routed"] > 0 for e in engines), f"one core got everything: {engines}"
    assert sum(e["num_routed"] for e in engines) == len(prompts)
    metrics = cluster.run(_get, cluster.url, "/metrics").text
    assert 'kvserve_engine_up{engine="0"} 1.0' in metrics
    assert 'kvserve_engine_up{engine="1"} 1.0' in metrics


def test_requests_sharing_a_prefix_stay_on_one_remote_core(cluster):
    prefix = list(range(100, 132))  # two full blocks of 16
    before = [e["num_routed"] for e in cluster.engines()]
    for suffix in range(4):
        status, _ = cluster.run(_complete, cluster.url, prefix + [200 + suffix], 2)
        assert status == 200
    after = [e["num_routed"] for e in cluster.engines()]
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 4]
    metrics = cluster.run(_get, cluster.url, "/metrics").text
    hits = [float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("kvserve_engine_prefix_cache_hits")]  # fmt: skip
    assert max(hits) >= 3 * 32  # the three repeats hit both prefix blocks on their core


def _probe(address: str, secret: bytes | None) -> object:
    """What a peer gets from a core port: with a secret, the handshake's outcome and the first frame;
    without, the raw bytes it reads after sending garbage."""
    sock = socket.create_connection((address, CORE_PORT), timeout=10)
    try:
        if secret is None:
            challenge = sock.recv(4096)
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
            sock.settimeout(10)
            rest = b""
            try:
                while chunk := sock.recv(4096):
                    rest += chunk
            except ConnectionResetError:
                pass
            return challenge, rest
        try:
            channel = client_handshake(sock, secret, CORE_MAGIC, peer="the engine core")
        except AuthenticationError as exc:
            return exc
        return msgspec.msgpack.decode(channel.recv_bytes(timeout_s=10), type=FromCore)
    finally:
        sock.close()


def test_unauthenticated_peers_are_refused_by_a_core(cluster):
    """From host A: a wrong secret and garbage are refused having read only the challenge; even the
    right secret gets no second session (the core serves one API server); the core goes on serving."""
    refused = cluster.run(_probe, cluster.c.address, b"not-the-secret-0123456789")
    assert isinstance(refused, AuthenticationError), refused
    assert "refused this node's secret" in str(refused)
    challenge, rest = cluster.run(_probe, cluster.c.address, None)
    assert challenge.startswith(CORE_MAGIC) and len(challenge) == len(CORE_MAGIC) + 32
    assert rest == b""  # closed, nothing told
    busy = cluster.run(_probe, cluster.c.address, SECRET.encode())
    assert isinstance(busy, CoreOutputs) and "already serves an API server" in busy.dead_reason
    assert "refused 10.77.0.1" in cluster.log(f"{cluster.c.address}.log")
    for prompt in PROMPTS[:2]:
        assert cluster.run(_complete, cluster.url, prompt, 2)[0] == 200
    assert all(e["alive"] for e in cluster.engines())


def test_killing_a_cores_host_fails_only_its_requests(cluster):
    """Core B's processes are killed while 8 requests run on B and C: exactly B's fail (503
    engine_dead, naming B), C's finish, /ready says which core is gone, and C keeps serving."""
    max_tokens = 150
    before = [e["num_routed"] for e in cluster.engines()]
    gate = cluster.gate
    gate.hold()
    futures = [cluster.pool.submit(_complete, cluster.url, p, max_tokens) for p in PROMPTS]
    gate.wait_held(len(PROMPTS))
    gate.step(1)  # their prompts, then held: all of them run when B dies
    running = lambda: sum(e["num_running"] for e in cluster.engines())  # noqa: E731
    assert wait_until(lambda: running() == len(PROMPTS), timeout_s=60, interval_s=0.05)
    routed = [a - b for a, b in zip((e["num_routed"] for e in cluster.engines()), before,
                                    strict=True)]  # fmt: skip
    assert sum(routed) == len(PROMPTS) and min(routed) > 0, routed
    assert not any(f.done() for f in futures), "requests finished before the core was killed"
    _kill(cluster.cores[0])
    gate.open()
    results = [f.result(timeout=180) for f in futures]
    failed = [body for status, body in results if status == 503]
    finished = [body for status, body in results if status == 200]
    assert len(failed) == routed[0] and len(finished) == routed[1], results
    for body in failed:
        assert body["error"]["code"] == "engine_dead"
        assert f"{cluster.b.address}:{CORE_PORT}" in body["error"]["message"]
    assert all(b["usage"]["completion_tokens"] == max_tokens for b in finished)
    ready = cluster.run(_get, cluster.url, "/ready")
    assert ready.status_code == 200
    dead, alive = ready.json()["engines"]
    assert not dead["alive"] and alive["alive"]
    assert dead["address"] == f"{cluster.b.address}:{CORE_PORT}"
    assert "connection lost" in dead["error"], dead
    for prompt in PROMPTS[:3]:  # C takes everything now
        assert cluster.run(_complete, cluster.url, prompt, 2)[0] == 200
    assert cluster.engines()[1]["num_routed"] >= routed[1] + 3


def test_a_cut_link_is_noticed_by_the_heartbeat(cluster):
    """C's link goes down (nothing is closed; packets stop): its request fails and, C being the last
    core, the API server exits 1, within the heartbeat timeout plus a margin."""
    cluster.gate.hold()
    cluster.gate.step(1)  # its prompt, then held: it is running when the link goes down
    future = cluster.pool.submit(_complete, cluster.url, PROMPTS[0], 200)
    assert wait_until(lambda: cluster.engines()[1]["num_running"] == 1, timeout_s=30)
    t_cut = time.monotonic()
    cluster.c.set_link(up=False)
    status, body = future.result(timeout=60)
    cluster.gate.open()
    detected_s = time.monotonic() - t_cut
    assert status == 503 and body["error"]["code"] == "engine_dead", body
    assert "missed its heartbeat" in body["error"]["message"]
    # the last heartbeat came up to 0.5 s (its period) before the cut
    assert HEARTBEAT_TIMEOUT_S - 1 <= detected_s < HEARTBEAT_TIMEOUT_S + 10, detected_s
    assert cluster.server.wait(60) == 1


def test_core_handshake_refuses_a_wrong_secret_and_the_tensor_parallel_protocol():
    """No model: the core's side of the handshake (socket pairs), and a tensor-parallel node that
    dials a core port by mistake is refused by its own check of the greeting."""
    for client_secret, magic, expect in (
        (b"right-secret-0123456789", CORE_MAGIC, None),
        (b"wrong-secret-0123456789", CORE_MAGIC, "refused this node's secret"),
        (b"right-secret-0123456789", None, "not a kvserve tensor-parallel node 0"),
    ):
        server_sock, client_sock = socket.socketpair()
        results = {}

        def serve(sock=server_sock, results=results) -> None:
            try:
                results["server"] = server_handshake(sock, b"right-secret-0123456789", CORE_MAGIC)
            except (AuthenticationError, ConnectionError, TimeoutError) as exc:
                results["server"] = exc
                sock.close()

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            if magic is None:
                client = client_handshake(client_sock, client_secret)
            else:
                client = client_handshake(client_sock, client_secret, magic, "the engine core")
        except AuthenticationError as exc:
            client = exc
            client_sock.close()  # as the API server does: the core sees the refusal as EOF
        thread.join(10)
        if expect is None:
            client.send_bytes(b"\x01\x02")
            assert results["server"].recv_bytes(timeout_s=5) == b"\x01\x02"
            client.close()
        else:
            assert isinstance(client, AuthenticationError) and expect in str(client)
            assert not hasattr(results["server"], "recv_bytes")


def test_a_remote_core_on_loopback(gpt2_model_dir, tmp_path):
    """No namespaces: one local and one remote core behind one server on 127.0.0.1; a server with the
    wrong secret fails to start with one line and the core goes on waiting for the right one."""
    port, api_port = free_port(), free_port()
    gate = FaultGate()
    held = ("--inject-fault", gate.spec())
    argv = _kvserve("engine-core", str(gpt2_model_dir), "--port", str(port), *ENGINE, *held)
    core = _start(argv, tmp_path / "core.log", _env())
    remote = f"--remote-engine-core=127.0.0.1:{port}"
    server = None
    try:
        wrong = subprocess.run(
            _kvserve("serve", str(gpt2_model_dir), "--port", str(api_port), *ENGINE, remote),
            env=_env("another-secret-0123456789"), capture_output=True, text=True,
            timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert wrong.returncode == 1, wrong.stderr[-3000:]
        lines = [x for x in wrong.stderr.splitlines() if x.startswith("kvserve serve: error:")]
        assert len(lines) == 1 and "refused this node's secret" in lines[0], wrong.stderr[-3000:]
        argv = _kvserve("serve", str(gpt2_model_dir), "--port", str(api_port), *ENGINE, remote,
                        "--data-parallel-size", "1", *held)  # fmt: skip
        server = _start(argv, tmp_path / "api.log", _env())
        url = f"http://127.0.0.1:{api_port}"
        ok = wait_until(lambda: _status(url) == 200, timeout_s=START_TIMEOUT_S, interval_s=0.5)
        assert ok, (tmp_path / "api.log").read_text()[-3000:]
        assert gate.num_cores == 2
        with ThreadPoolExecutor(4) as pool, gate.held():
            # at once, and held until all four have arrived: the least loaded core is not always 0
            futures = [pool.submit(_complete, url, p) for p in PROMPTS[:4]]
            gate.wait_held(4)
            gate.open()
            results = [f.result(timeout=120) for f in futures]
        assert [status for status, _ in results] == [200] * 4
        engines = _get(url, "/ready").json()["engines"]
        assert all(e["num_routed"] > 0 for e in engines), engines
        assert [e["address"] for e in engines] == [None, f"127.0.0.1:{port}"]
        assert engines[1]["pid"] != engines[0]["pid"]
    finally:
        if server is not None:
            _kill(server)
        _kill(core)
        gate.close()


def _status(url: str) -> int | None:
    try:
        return _get(url, "/ready").status_code
    except httpx.HTTPError:
        return None
