"""The engine core in its own process: a real SIGKILL of the core mid-stream gives 503s, /health and
/ready 503 with the reason, and a non-zero exit; data parallel (two cores behind one server) gives each
request the same greedy output as one engine, keeps requests that share a prefix on one core, labels
each core's metrics, and takes a dead core out of rotation while the other serves."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import build_engine_config
from kvserve.engine.faults import FaultInjection
from kvserve.engine.llm import LLM
from tests.faults import FaultGate
from tests.server_utils import free_port, running_server, wait_until

pytestmark = pytest.mark.slow

SMALL = ("--max-model-len", "256", "--kv-cache-memory", "16MiB")


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def _stream_then_kill(url: str, pid: int, gate: FaultGate) -> list[str]:
    """Start a long stream, SIGKILL the core after its first chunk, return the stream's other events.
    The core is held after a few steps, so the stream is still running when the core dies."""
    gate.hold()
    gate.step(5)
    with httpx.Client(timeout=60) as http:
        body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", f"{url}/v1/completions", json=body) as in_flight:
            assert in_flight.status_code == 200
            lines = in_flight.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, signal.SIGKILL)
            return [line[6:] for line in lines if line.startswith("data: ")]


def test_killed_core_fails_requests_with_503_and_health_says_why(gpt2_model_dir):
    import uvicorn

    from kvserve.engine.mp_client import MPClient
    from kvserve.server.app import build_app
    from kvserve.server.serving import ServingOptions

    config = build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=256)
    gate = FaultGate()
    app = build_app(
        lambda: MPClient(config, faults=FaultInjection(step_gate=gate.address)),
        ServingOptions(served_model_name="m"),
    )  # no on_fatal: the server stays up, so what it says can be checked
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _status(f"{url}/ready") == 200, timeout_s=180)
        pid = httpx.get(f"{url}/ready").json()["engines"][0]["pid"]
        assert pid != os.getpid()
        rest = _stream_then_kill(url, pid, gate)
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_dead" and "exited with code -9" in error["message"]
        for path in ("/health", "/ready"):
            response = httpx.get(f"{url}{path}")
            assert response.status_code == 503
            assert "exited with code -9" in response.json()["error"]
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
        assert after.json()["error"]["type"] == "service_unavailable"
    finally:
        server.should_exit = True
        thread.join(30)
        gate.close()


def test_killed_core_makes_the_server_exit_non_zero(gpt2_model_dir):
    with FaultGate() as gate:
        args = (*SMALL, "--engine-core", "process", "--inject-fault", gate.spec())
        with running_server(gpt2_model_dir, *args) as (url, proc):
            pid = httpx.get(f"{url}/ready").json()["engines"][0]["pid"]
            rest = _stream_then_kill(url, pid, gate)
            assert json.loads(rest[-2])["error"]["code"] == "engine_dead"
            assert proc.wait(timeout=60) == 1


def test_missed_heartbeat_is_a_dead_core(gpt2_model_dir):
    """A core that stops (SIGSTOP: alive, silent) is declared dead after the heartbeat timeout."""
    from kvserve.engine.mp_client import MPClient

    config = build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=256)
    died = threading.Event()
    client = MPClient(config, heartbeat_timeout_s=2.0, on_dead=lambda reason: died.set())
    try:
        os.kill(client.core_pids[0], signal.SIGSTOP)
        assert died.wait(30)
        assert "missed its heartbeat" in client.dead_reason
    finally:
        client.shutdown()


# --- data parallel --------------------------------------------------------------------------------------

PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(20 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def dp_server(gpt2_model_dir):
    args = (*SMALL, "--engine-core", "process", "--data-parallel-size", "2")
    with running_server(gpt2_model_dir, *args) as (url, proc):
        yield url, proc


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[str, int]:
    """(text, completion tokens) of a greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    return out["choices"][0]["text"], out["usage"]["completion_tokens"]


def test_data_parallel_gives_each_request_the_greedy_output_of_one_engine(
    dp_server, gpt2_model_dir
):
    url, _ = dp_server
    llm = LLM(str(gpt2_model_dir), max_model_len=256, num_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [(o.outputs[0].text, 8) for o in llm.generate(PROMPTS, params)]
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = _complete(url, PROMPTS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(len(PROMPTS))] == expected
    engines = httpx.get(f"{url}/ready").json()["engines"]
    assert len(engines) == 2 and all(e["alive"] for e in engines)
    assert len({e["pid"] for e in engines} | {dp_server[1].pid}) == 3  # two processes of their own
    assert all(e["num_routed"] > 0 for e in engines), f"one core got everything: {engines}"


def test_requests_sharing_a_prefix_land_on_the_same_core(dp_server):
    url, _ = dp_server
    prefix = list(range(100, 132))  # two full blocks of 16
    before = [e["num_routed"] for e in httpx.get(f"{url}/ready").json()["engines"]]
    for suffix in range(4):
        _complete(url, prefix + [200 + suffix], max_tokens=2)
    after = [e["num_routed"] for e in httpx.get(f"{url}/ready").json()["engines"]]
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 4]
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvserve_engine_up{engine="0"} 1.0' in metrics
    assert 'kvserve_engine_up{engine="1"} 1.0' in metrics
    hits = {
        line.split("{")[1].split("}")[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("kvserve_engine_prefix_cache_hits")
    }
    assert sorted(hits.values())[-1] >= 3 * 32  # the three repeats hit both prefix blocks  # fmt: skip


def test_a_dead_core_is_taken_out_of_rotation(dp_server):
    """Core 0 dies (it was also the one every request's check went to: then every request failed with
    engine_dead while core 1 lived)."""
    url, proc = dp_server
    engines = httpx.get(f"{url}/ready").json()["engines"]
    os.kill(engines[0]["pid"], signal.SIGKILL)
    assert wait_until(
        lambda: not httpx.get(f"{url}/ready").json()["engines"][0]["alive"], timeout_s=30
    )
    for prompt in PROMPTS[:3]:
        assert _complete(url, prompt, max_tokens=2)[1] == 2
    ready = httpx.get(f"{url}/ready")
    assert ready.status_code == 200 and proc.poll() is None
    assert "exited with code -9" in ready.json()["engines"][0]["error"]
    assert 'kvserve_engine_up{engine="0"} 0.0' in httpx.get(f"{url}/metrics").text
