"""The browser pages in a real headless Chromium (Debian's, driven by Playwright): the playground's
chat round trip renders the streamed reply (the same text the API gives for the same request), its
constraint box constrains; the dashboard's numbers follow the server's counters under load; /docs
renders from packaged assets; no page asks any host but the server.

Screenshots go to $KVSERVE_ARTIFACTS_DIR (default: the test's tmp dir); with
KVSERVE_UPDATE_SCREENSHOTS=1 they also replace docs/images/*.png, which the README shows.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests import REPO_ROOT
from tests.faults import FaultGate
from tests.server_utils import running_server

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "chromium is not installed (make test installs it: apt-get install -y chromium)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)

REPO = REPO_ROOT
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TIMEOUT_MS = 180_000


@pytest.fixture(scope="module")
def gate():
    """The dashboard test holds the engine while the page shows its load (tests/faults.py): without
    that the 4 x 48-token load fits between two of its polls and no running request is ever seen."""
    with FaultGate() as gate:
        yield gate


@pytest.fixture(scope="module")
def server_url(gate):
    args = ("--kv-cache-memory", "64MiB", "--inject-fault", gate.spec())
    with running_server("kvserve-demo", *args) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    path = os.environ.get("KVSERVE_ARTIFACTS_DIR")
    out = Path(path) if path else tmp_path_factory.mktemp("web-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _screenshot(page, artifacts: Path, name: str) -> None:
    page.screenshot(path=str(artifacts / name))
    if os.environ.get("KVSERVE_UPDATE_SCREENSHOTS") == "1":
        shutil.copy(artifacts / name, REPO / "docs" / "images" / name)


@pytest.fixture
def page(browser, server_url):
    """A fresh page that records every host it requests and every console error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    pg.hosts, pg.errors = set(), []
    pg.on("request", lambda r: pg.hosts.add(urlparse(r.url).netloc))
    pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)
    yield pg
    assert pg.hosts <= {urlparse(server_url).netloc}, f"requests left the server: {pg.hosts}"
    assert not pg.errors, pg.errors
    context.close()


def _send(page, prompt: str, max_tokens: int) -> dict:
    page.wait_for_selector("#model option", state="attached")
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state=done]")
    return {
        "text": page.inner_text(".msg.assistant .text"),
        "stats": page.inner_text(".msg.assistant .stats"),
    }


def test_playground_chat_round_trip_renders_the_streamed_reply(page, server_url, artifacts):
    page.goto(f"{server_url}/")
    shown = _send(page, "def fibonacci(n):", 24)
    # the oracle: the same request through the API, not streamed (greedy, so deterministic)
    body = {
        "model": "kvserve-demo",
        "messages": [{"role": "user", "content": "def fibonacci(n):"}],
        "max_tokens": 24,
        "temperature": 0,
        "top_p": 1,
        "top_k": 0,
        "repetition_penalty": 1,
    }
    reply = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=120).json()
    assert shown["text"] == reply["choices"][0]["message"]["content"] and shown["text"].strip()
    assert re.search(
        r"TTFT \d+ ms · [\d.]+ tok/s · 24 tokens · prompt \d+ \(cached \d+\)", shown["stats"]
    )
    assert reply["system_fingerprint"] in shown["stats"]
    assert reply["system_fingerprint"] in page.inner_text("#fingerprint")
    _screenshot(page, artifacts, "playground.png")


def test_playground_constraint_box_constrains_the_reply(page, server_url):
    page.goto(f"{server_url}/")
    page.select_option("#constraint_kind", "regex")
    page.fill("#constraint", "[0-9]{4}")
    shown = _send(page, "The year was", 8)
    assert re.fullmatch(r"[0-9]{4}", shown["text"]), shown
    assert "finish stop" in shown["stats"]


def test_playground_shows_a_bad_constraint_as_an_error(page, server_url):
    page.goto(f"{server_url}/")
    page.select_option("#constraint_kind", "regex")
    page.fill("#constraint", "[0-9")
    page.wait_for_selector("#model option", state="attached")
    page.fill("#prompt", "x")
    page.click("#send")
    page.wait_for_selector(".msg.error")
    message = page.inner_text(".msg.error")
    assert "HTTP 400" in message and "invalid regex constraint" in message
    assert ".cc:" not in message  # the compiler's source path is not shown
    page.errors.clear()  # the browser logs the 400 itself


def _number(page, selector: str) -> float:
    return float(page.inner_text(selector).replace(",", ""))


def test_dashboard_numbers_follow_the_server_under_load(page, server_url, artifacts, gate):
    page.goto(f"{server_url}/dashboard?interval_ms=250")
    page.wait_for_function("Number(document.body.dataset.polls || 0) >= 2")
    generated_before = _number(page, "#gen-total")
    num_requests, max_tokens = 4, 48
    body = {"model": "kvserve-demo", "prompt": "import os\n", "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    results: list[int] = []

    def client() -> None:
        resp = httpx.post(f"{server_url}/v1/completions", json=body, timeout=300)
        results.append(resp.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=client) for _ in range(num_requests)]
    with gate.held():
        for t in threads:
            t.start()
        gate.wait_held(num_requests)
        gate.step(1)  # their prompts, then held: under load while the page polls
        # under load: requests are seen running, and the KV cache is in use
        page.wait_for_function("Number(document.getElementById('running').textContent) >= 1")
        page.wait_for_function("document.getElementById('kv-usage').textContent !== '0.0%'")
        _screenshot(page, artifacts, "dashboard-under-load.png")
    for t in threads:
        t.join()
    assert results == [max_tokens] * num_requests
    expected = generated_before + num_requests * max_tokens
    page.wait_for_function(
        f"Number(document.getElementById('gen-total').textContent.replace(/,/g, '')) === {expected}"
    )
    # the window's TTFT histogram holds exactly these requests, and its percentiles are numbers
    page.wait_for_function(
        f"document.querySelector('#row-time_to_first_token .count').textContent === '{num_requests}'"
    )
    for cell in ("p50", "p90", "p99", "mean"):
        text = page.inner_text(f"#row-time_to_first_token .{cell}")
        assert re.fullmatch(r"[\d.]+ m?s", text), (cell, text)
    itl_count = _number(page, "#row-inter_token_latency .count")
    assert itl_count == num_requests * (max_tokens - 1)
    assert _number(page, "#tok-rate") > 0
    # the charts have a time axis: wall-clock labels under the plot (issue 46)
    page.wait_for_function(
        "(document.getElementById('chart-tokens').dataset.timeAxis || '').length"
    )
    for chart in ("#chart-queue", "#chart-tokens"):
        labels = page.get_attribute(chart, "data-time-axis").split()
        assert len(labels) >= 2 and all(re.fullmatch(r"\d\d:\d\d:\d\d", x) for x in labels), labels
    _screenshot(page, artifacts, "dashboard.png")


def test_dashboard_rates_are_over_the_busy_time(page, server_url):
    """issue 46: the window's tokens/s disagreed with the load tool's: it divided by the whole window
    (idle polls included). A 60 s run inside a 5-minute window, polled every 2 s: 6,000 tokens."""
    page.goto(f"{server_url}/dashboard")
    page.wait_for_function("Number(document.body.dataset.polls || 0) >= 1")
    span = page.evaluate("""() => {
      const snap = (t, running, tokens) => ({ t, m: new Map([
        ["kvserve_num_requests_running", running], ["kvserve_num_requests_waiting", 0],
        ["kvserve_generation_tokens_total", tokens], ["kvserve_request_success_total", tokens / 100]]) });
      const recent = [];
      for (let t = 0; t <= 300; t += 2) {
        const running = t > 101 && t < 161 ? 4 : 0;  // the run: from 101 s to 161 s
        const tokens = t < 101 ? 0 : Math.min(6000, Math.floor((t - 101) / 10) * 1000);
        recent.push(snap(t, running, tokens));
      }
      const s = busySpan(recent);
      return { seconds: s.seconds, tokens: s.end.m.get("kvserve_generation_tokens_total")
               - s.start.m.get("kvserve_generation_tokens_total") };
    }""")
    assert span["tokens"] == 6000
    assert abs(span["tokens"] / span["seconds"] - 100.0) <= 5.0, span  # the load tool's 100 tok/s


def test_docs_render_from_packaged_swagger_assets(page, server_url):
    page.goto(f"{server_url}/docs")
    page.wait_for_selector(".swagger-ui .opblock")
    paths = page.inner_text(".swagger-ui")
    assert "/v1/chat/completions" in paths and "/reset_prefix_cache" in paths
    assert httpx.get(f"{server_url}/redoc").status_code == 404  # it would load a CDN: off


@pytest.fixture(scope="module")
def keyed_url():
    args = ("--api-key", "web:s3cret-key", "--kv-cache-memory", "64MiB")
    with running_server("kvserve-demo", *args) as (url, _):
        yield url


def test_pages_with_api_key_ask_for_it_and_send_it(browser, keyed_url):
    """issue 46: with --api-key every page and asset answered 401. They load, ask for the key once per
    tab (sessionStorage only: no cookie, nothing on disk), and every API call sends it."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    sent: list[tuple[str, str | None]] = []
    pg.on("request", lambda r: sent.append((urlparse(r.url).path, r.headers.get("authorization"))))
    try:
        pg.goto(f"{keyed_url}/")
        pg.wait_for_selector("#auth-form")  # /v1/models answered 401: the page asks
        pg.fill("#auth-key", "s3cret-key")
        pg.click("#auth-submit")
        shown = _send(pg, "def fibonacci(n):", 8)
        assert shown["text"].strip() and "8 tokens" in shown["stats"]
        assert pg.evaluate("sessionStorage.getItem('kvserve_api_key')") == "s3cret-key"
        assert pg.evaluate("localStorage.length") == 0 and context.cookies() == []
        # the dashboard, same tab: no second question, and /ready's details (they need the key)
        pg.goto(f"{keyed_url}/dashboard?interval_ms=250")
        pg.wait_for_function("Number(document.body.dataset.polls || 0) >= 2")
        assert pg.inner_text("#model") == "kvserve-demo"
        assert pg.query_selector("#auth-form") is None
        pg.goto(f"{keyed_url}/docs")
        pg.wait_for_selector(".swagger-ui .opblock")
        assert "/v1/chat/completions" in pg.inner_text(".swagger-ui")
        api = [(p, a) for p, a in sent if p.startswith("/v1/") or p in ("/ready", "/openapi.json")]
        keyed = [p for p, a in api if a == "Bearer s3cret-key"]
        assert {"/v1/chat/completions", "/ready", "/openapi.json"} <= set(keyed), api
        unkeyed = [p for p, a in api if a is None]
        assert unkeyed == ["/v1/models"], api  # the first call only, which asked for the key
    finally:
        context.close()
