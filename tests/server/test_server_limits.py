"""Server limits and lifecycle: API keys, queue limit (429), request timeout, readiness, SIGTERM."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from kvserve.engine.args import build_engine_config
from kvserve.engine.core import EngineCore
from tests.faults import FaultGate
from tests.server_utils import NotifyingServer, free_port, running_server, wait_until

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell a long story:", "max_tokens": 450, "ignore_eos": True}


def test_api_key_and_queue_limit(gpt2_model_dir):
    with running_server(
        gpt2_model_dir,
        "--api-key",
        "s3cret",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
        "--max-model-len",
        "512",
    ) as (url, _):
        missing = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        wrong = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"}
        )
        for response in (missing, wrong):
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{url}/health").status_code == 200  # liveness needs no key
        auth = {"Authorization": "Bearer s3cret"}
        ok = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth
        )
        assert ok.status_code == 200

        # One running (max_num_seqs 1), one waiting (= --max-waiting): the next is refused.
        with httpx.Client(timeout=60, headers=auth) as http:
            with http.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as a:
                a_lines = a.iter_lines()  # keep the iterator: closing it would close the connection
                next(a_lines)
                with http.stream(
                    "POST", f"{url}/v1/completions", json={**LONG, "stream": True}
                ) as b:
                    assert wait_until(lambda: http.get(f"{url}/ready").json()["num_waiting"] == 1)
                    refused = http.post(
                        f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}
                    )
                    assert refused.status_code == 429
                    assert refused.headers["retry-after"] == "1"
                    assert refused.json()["error"]["type"] == "rate_limit_error"
                    assert b.status_code == 200
        # without the key /ready says only whether it is ready; its details need the key
        assert httpx.get(f"{url}/ready").json() == {"status": "ready"}
        state = wait_until(
            lambda: httpx.get(f"{url}/ready", headers=auth).json()["num_unfinished"] == 0
        )
        assert state
        after = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth
        )
        assert after.status_code == 200


def test_request_timeout_aborts_and_reports(gpt2_model_dir):
    # The engine's steps and grammar compiles are held (tests/faults.py) until the 0.3 s budgets ran
    # out: a long request always times out first, and so does a new grammar's check in the core.
    steps, compiles = FaultGate(), FaultGate()
    faults = f"{steps.spec()},{compiles.spec('grammar-gate')}"
    args = ("--request-timeout", "0.3", "--max-model-len", "512", "--engine-core", "process",
            "--inject-fault", faults)  # fmt: skip
    with steps, compiles, running_server(gpt2_model_dir, *args) as (url, _):
        steps.hold()
        compiles.hold()
        # fuzzing: the budget started after preparation, so a slow grammar got its 504 only when done
        grammar = {"prompt": "hi", "max_tokens": 2, "guided_regex": "[0-9]+"}
        compiling = httpx.post(f"{url}/v1/completions", json=grammar, timeout=60)
        assert compiling.status_code == 504, compiling.text
        assert compiling.json()["error"]["code"] == "request_timeout"
        slow = httpx.post(f"{url}/v1/completions", json=LONG, timeout=60)
        assert slow.status_code == 504
        assert slow.json()["error"]["code"] == "request_timeout"
        streamed = httpx.post(
            f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=60
        ).text
        events = [e[6:] for e in streamed.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        debug = wait_until(
            lambda: (d := httpx.get(f"{url}/debug/engine").json())["num_requests"] == 0 and d
        )
        assert debug["num_free_blocks"] == debug["num_blocks"]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvserve_request_errors_total{error_type="timeout_error"} 3.0' in metrics
        steps.open()
        compiles.open()
        quick = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert quick.status_code == 200


def test_sigterm_lets_in_flight_requests_finish(gpt2_model_dir):
    with running_server(gpt2_model_dir, "--grace-period", "30", "--max-model-len", "512") as (
        url,
        proc,
    ):
        body = {"prompt": "Count:", "max_tokens": 120, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line:
                        continue  # the blank line that ends each event
                    lines.append(line)
                    if len(lines) == 3:
                        proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0  # a clean drain exits 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)


def test_ready_is_503_while_loading(gpt2_model_dir):
    import uvicorn

    from kvserve.server.app import build_app
    from kvserve.server.serving import ServingOptions

    release = threading.Event()
    config = build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=512)

    def slow_factory():
        from kvserve.engine.async_engine import AsyncEngine

        release.wait(60)
        return AsyncEngine(EngineCore(config))

    app = build_app(slow_factory, ServingOptions(served_model_name="m"))
    port = free_port()
    server = NotifyingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = server.start_in_thread()
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        loading = httpx.get(f"{url}/ready")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        busy = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "service_unavailable"
        release.set()
        assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, timeout_s=60)
        ready = httpx.get(f"{url}/ready").json()
        assert ready["model"] == "m" and len(ready["manifest_sha256"]) == 64
        assert ready["kv_free_blocks"] == ready["kv_total_blocks"] == 64
        manifest = httpx.get(f"{url}/manifest").json()["manifest"]
        assert set(manifest["weights_sha256"]) == {"model.safetensors"}
        assert "tokenizer.json" in manifest["tokenizer_sha256"] and manifest["dtype"] == "float32"
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def test_loading_503s_are_not_errors_and_ready_details_need_the_key(gpt2_model_dir):
    """issue 46: the dashboard counted the loading phase's 503s as request errors (1,016 of 1,047),
    and /ready without a key gave the manifest hash, queue, KV usage and engine PIDs."""
    import uvicorn

    from kvserve.server.app import build_app
    from kvserve.server.serving import ServingOptions
    from tests.server.test_server import metric_values

    release = threading.Event()
    config = build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=512)

    def slow_factory():
        from kvserve.engine.async_engine import AsyncEngine

        release.wait(60)
        return AsyncEngine(EngineCore(config))

    app = build_app(slow_factory, ServingOptions(served_model_name="m"), api_keys=("a:secret",))
    port = free_port()
    server = NotifyingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = server.start_in_thread()
    url, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer secret"}
    try:
        for _ in range(3):
            busy = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=key)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_loading"
        assert httpx.get(f"{url}/ready").json() == {"status": "loading"}
        values = metric_values(url)
        assert values[("kvserve_not_ready_requests_total", ())] == 3
        assert not any(k[0] == "kvserve_request_errors_total" for k in values), values
        release.set()
        assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, timeout_s=60)
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert httpx.get(f"{url}/ready", headers=headers).json() == {"status": "ready"}
        ready = httpx.get(f"{url}/ready", headers=key).json()
        assert ready["model"] == "m" and len(ready["manifest_sha256"]) == 64
        assert ready["kv_total_blocks"] == 64 and "engines" in ready
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def test_preparation_keeps_the_engines_timeout_apart_from_the_requests():
    """review: `prepare` took any TimeoutError for the request's budget running out (with no budget set
    it then failed formatting None). The engine's own TimeoutError stays itself; the budget's is a 504."""
    import asyncio

    from kvserve.server.errors import APIError
    from kvserve.server.serving import OpenAIServing, ServingOptions

    serving = object.__new__(OpenAIServing)  # only prepare()'s time budget is exercised

    def engine_late(s, request):
        raise TimeoutError("the engine core did not answer in time")

    for budget in (None, 30.0):
        serving.options = ServingOptions(served_model_name="m", request_timeout_s=budget)
        with pytest.raises(TimeoutError, match="did not answer"):
            asyncio.run(serving.prepare(engine_late, None))
    release = threading.Event()

    def slow(s, request):
        release.wait(30)  # set once the 504 is out, so the worker thread ends

    serving.options = ServingOptions(served_model_name="m", request_timeout_s=0.05)
    with pytest.raises(APIError) as info:
        asyncio.run(serving.prepare(slow, None))
    release.set()
    assert info.value.status_code == 504 and info.value.code == "request_timeout"
