"""A dead engine says so and exits non-zero; SIGTERM drains within the grace period, cutting what is left with
an error event, and a clean drain exits 0. Faults and slowness are injected (--inject-fault), never raced."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.engine.args import build_engine_config
from kvserve.engine.core import EngineCore
from kvserve.engine.faults import FaultInjection
from tests.faults import FaultGate
from tests.server_utils import free_port, running_server, sse_events, wait_until

pytestmark = pytest.mark.slow

ENGINE_FAULT_SEED = 4321  # the loop itself fails after the step that follows this request's arrival
SMALL = ("--max-model-len", "256", "--kv-cache-memory", "16MiB")


@pytest.mark.parametrize("mode", ["in-process", "process"])
def test_dead_engine_health_ready_and_requests_are_503(gpt2_model_dir, mode):
    import uvicorn

    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.mp_client import MPClient
    from kvserve.server.app import build_app
    from kvserve.server.serving import ServingOptions

    config = build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=256)
    gate = FaultGate()
    faults = FaultInjection(engine_seed=ENGINE_FAULT_SEED, step_gate=gate.address)

    def factory():
        if mode == "in-process":
            return AsyncEngine(EngineCore(config), faults=faults)
        return MPClient(config, faults=faults)

    app = build_app(
        factory, ServingOptions(served_model_name="m")
    )  # no on_fatal: the server stays up, so what it says can be checked
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _status(f"{url}/ready") == 200, timeout_s=120)
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
            gate.hold()
            gate.step(2)  # its first tokens, then held: it is in flight when the engine dies
            with http.stream("POST", f"{url}/v1/completions", json=body) as in_flight:
                lines = in_flight.iter_lines()
                next(lines)
                killer = pool.submit(
                    http.post,
                    f"{url}/v1/completions",
                    json={"prompt": "x", "max_tokens": 2, "seed": ENGINE_FAULT_SEED},
                )
                gate.wait_held(2)
                gate.open()  # the step after the killer's arrival fails the loop
                killer = killer.result(timeout=60)
                rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert killer.status_code == 503 and killer.json()["error"]["code"] == "engine_dead"
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_dead"
        for path in ("/health", "/ready"):
            response = httpx.get(f"{url}{path}")
            assert response.status_code == 503
            assert "injected engine fault" in response.json()["error"]
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    finally:
        server.should_exit = True
        thread.join(30)
        gate.close()


def test_dead_engine_process_answers_then_exits_non_zero(gpt2_model_dir):
    args = (*SMALL, "--inject-fault", f"engine:{ENGINE_FAULT_SEED}")
    with running_server(gpt2_model_dir, *args) as (url, proc):
        killer = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "seed": ENGINE_FAULT_SEED},
            timeout=60,
        )
        assert killer.status_code == 503 and killer.json()["error"]["code"] == "engine_dead"
        assert proc.wait(timeout=30) == 1


def test_grace_expiry_cuts_open_streams_with_an_error_event(gpt2_model_dir, tmp_path):
    log = tmp_path / "server.log"
    grace_s = 1.0
    gate = FaultGate()
    args = (*SMALL, "--grace-period", str(grace_s), "--inject-fault", gate.spec(),
            "--log-level", "info")  # fmt: skip
    with gate, running_server(gpt2_model_dir, *args, log_path=log) as (url, proc):
        body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        gate.hold()
        gate.step(2)  # its first tokens, then held: the stream outlasts the grace period
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "server_shutdown" and error["type"] == "service_unavailable"
        assert proc.wait(timeout=grace_s + 15) == 0
    text = log.read_text()
    assert '"outcome": "service_unavailable"' in text and "client_closed_request" not in text


def test_clean_drain_exits_zero(gpt2_model_dir):
    with running_server(gpt2_model_dir, *SMALL, "--grace-period", "30") as (url, proc):
        body = {"prompt": "Count:", "max_tokens": 30, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http:
            response = http.post(f"{url}/v1/completions", json=body)
            events = sse_events(response)
        assert events[-1] == "[DONE]"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
