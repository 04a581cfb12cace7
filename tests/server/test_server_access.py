"""API keys on every route but /health, /ready, /metrics and the pages (checked before the body is parsed), per-key
metering (Prometheus counters by key id and outcome, GET /v1/usage) and an exact --max-waiting bound."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.faults import FaultGate
from tests.server.test_server import metric_values
from tests.server_utils import running_server, wait_until

pytestmark = pytest.mark.slow

ALICE = {"Authorization": "Bearer alice-secret"}
BOB = {"Authorization": "Bearer bob-secret"}
MAX_WAITING = 3
# One running at a time, and an engine the tests hold (tests/faults.py): a burst arrives while the
# first runs.
ARGS = ("--api-key", "alice:alice-secret", "--api-key", "bob:bob-secret", "--max-num-seqs", "1",
        "--max-waiting", str(MAX_WAITING), "--max-model-len", "256",
        "--kv-cache-memory", "16MiB", "--log-level", "info")  # fmt: skip


@pytest.fixture(scope="module")
def gate():
    with FaultGate() as gate:
        yield gate


@pytest.fixture(scope="module")
def server(gpt2_model_dir, tmp_path_factory, gate):
    log = tmp_path_factory.mktemp("access") / "server.log"
    args = (*ARGS, "--inject-fault", gate.spec())
    with running_server(gpt2_model_dir, *args, log_path=log) as (url, _):
        yield url, log


@pytest.mark.parametrize(
    "method, path",
    [("GET", "/debug/engine"), ("GET", "/manifest"), ("GET", "/v1/models"), ("GET", "/v1/usage"),
     ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/reset_prefix_cache"),
     ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/openapi.json")],
)  # fmt: skip
def test_every_route_needs_the_key(server, method, path):
    url, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "alice-secret"}):
        response = httpx.request(method, f"{url}{path}", headers=headers, json={})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.request(method, f"{url}{path}", headers=ALICE, json={}).status_code != 401


def test_open_routes_and_key_checked_before_the_body(server):
    url, _ = server
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 200
    before = metric_values(url)
    broken = httpx.post(
        f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    deep = httpx.post(f"{url}/v1/completions", content=b"[" * 1000)
    assert broken.status_code == deep.status_code == 401  # never parsed
    after = metric_values(url)
    assert (
        after[("kvserve_unauthorized_requests_total", ())]
        - before.get(("kvserve_unauthorized_requests_total", ()), 0)
        == 2
    )
    errors = {k: v for k, v in after.items() if k[0] == "kvserve_request_errors_total"}
    assert all(v == before.get(k, 0) for k, v in errors.items()), "401s are not request errors"


def test_pages_and_their_assets_load_without_a_key(server):
    """issue 46: with --api-key the pages answered 401 (a browser cannot send a header when it opens
    a page); they load, ask for the key and send it (tests/server/test_web.py drives that in a browser)."""
    url, _ = server
    for path in ("/", "/dashboard", "/docs", "/static/auth.js", "/static/dashboard.js",
                 "/static/swagger/swagger-ui-bundle.js"):  # fmt: skip
        assert httpx.get(f"{url}{path}").status_code == 200, path
    assert httpx.get(f"{url}/static/../openapi.json").status_code == 401  # no way around the key
    # /ready without a key: ready or not, nothing else; with it, the details
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.get(f"{url}/ready", headers=headers).json() == {"status": "ready"}
    assert "manifest_sha256" in httpx.get(f"{url}/ready", headers=ALICE).json()


def test_metering_per_key_with_failed_attempts_and_usage(server):
    url, _ = server
    before = metric_values(url)
    ok = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hello there", "max_tokens": 5, "ignore_eos": True},
        headers=ALICE,
    )
    assert ok.status_code == 200
    usage = ok.json()["usage"]
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "top_p": 9}, headers=ALICE)
    assert bad.status_code == 400
    bob = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=BOB)
    assert bob.status_code == 200
    after = metric_values(url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("kvserve_key_requests_total", key_id="alice", outcome="ok") == 1
    assert delta("kvserve_key_requests_total", key_id="alice", outcome="rejected") == 1
    assert delta("kvserve_key_requests_total", key_id="bob", outcome="ok") == 1
    assert delta("kvserve_key_prompt_tokens_total", key_id="alice") == usage["prompt_tokens"]
    assert delta("kvserve_key_generation_tokens_total", key_id="alice") == 5
    text = httpx.get(f"{url}/metrics").text
    assert "alice-secret" not in text and "bob-secret" not in text

    mine = httpx.get(f"{url}/v1/usage", headers=BOB).json()
    assert mine["key_id"] == "bob" and mine["requests"]["ok"] >= 1
    assert mine["completion_tokens"] >= 2 and "alice" not in str(mine)


def test_aborted_stream_is_metered(server, gate):
    url, _ = server
    before = httpx.get(f"{url}/v1/usage", headers=BOB).json()
    body = {"prompt": "Long:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with gate.held(), httpx.Client(timeout=60, headers=BOB) as http:
        gate.step(10)  # then held: the stream is running when the client leaves
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received >= 3:
                    break
        after = wait_until(
            lambda: (
                (u := httpx.get(f"{url}/v1/usage", headers=BOB).json())["requests"].get(
                    "aborted", 0
                )
                > before["requests"].get("aborted", 0)
                and u
            )
        )
    assert after, "the aborted stream was not metered"
    assert after["completion_tokens"] - before["completion_tokens"] >= 2
    assert after["prompt_tokens"] > before["prompt_tokens"]


def test_max_waiting_is_exact(server, gate):
    url, _ = server
    long = {"prompt": "Story:", "max_tokens": 240, "ignore_eos": True}
    burst = 8
    assert wait_until(
        lambda: httpx.get(f"{url}/ready", headers=ALICE).json()["num_unfinished"] == 0
    )

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=ALICE) as http:
            first = asyncio.create_task(http.post(f"{url}/v1/completions", json=long))
            await asyncio.to_thread(
                wait_until,
                lambda: httpx.get(f"{url}/ready", headers=ALICE).json()["num_running"] == 1,
            )
            others = [
                asyncio.create_task(
                    http.post(f"{url}/v1/completions", json=long | {"max_tokens": 2})
                )
                for _ in range(burst)
            ]
            # the 429s come at once, while the engine is held; the rest only after it goes on
            refused = burst - MAX_WAITING
            done = await asyncio.to_thread(
                wait_until, lambda: sum(t.done() for t in others) >= refused and others
            )
            assert done and sum(t.done() for t in others) == refused
            await asyncio.to_thread(gate.open)
            return await first, await asyncio.gather(*others)

    with gate.held():
        gate.step(1)  # the first's prompt, then held: it runs while the burst arrives
        first, others = asyncio.run(main())
    assert first.status_code == 200
    codes = sorted(r.status_code for r in others)
    assert codes == [200] * MAX_WAITING + [429] * (burst - MAX_WAITING), codes
    assert all(r.headers["retry-after"] == "1" for r in others if r.status_code == 429)
    assert httpx.get(f"{url}/ready", headers=ALICE).json()["num_waiting"] == 0
