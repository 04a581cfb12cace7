"""No single request kills, stalls or misleads the server: every trigger gets an OpenAI-shaped error with the
right status, and a normal request succeeds right after it (docs/server.md, "Errors" and "Limits")."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.faults import FaultGate
from tests.server_utils import running_server, sse_events, wait_until

pytestmark = pytest.mark.slow

FAULT_SEED = (
    1234  # --inject-fault request:1234: the runner fails while preparing a request with this seed
)
MAX_BYTES = 200_000
ARGS = ("--kv-cache-memory", "16MiB", "--max-model-len", "256", "--max-num-seqs", "4",
        "--max-request-bytes", str(MAX_BYTES),
        "--max-waiting", "32", "--max-request-tokens", "4096", "--log-level", "info")  # fmt: skip
NORMAL = {"prompt": "hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def gate():
    """Open unless a test holds the engine (tests/faults.py)."""
    with FaultGate() as gate:
        yield gate


@pytest.fixture(scope="module")
def server(gpt2_model_dir, tmp_path_factory, gate):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    faults = f"request:{FAULT_SEED},{gate.spec()}"
    with running_server(gpt2_model_dir, *ARGS, "--inject-fault", faults, log_path=log) as (url, _):
        yield url, log


def assert_openai_error(response: httpx.Response, status: int, param=None, fragment: str = ""):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert fragment in error["message"], error
    return error


def assert_still_serving(url: str) -> None:
    ok = httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"seed": 18446744073709551616}, "seed"),
        ({"seed": -9223372036854775809}, "seed"),
        ({"top_k": 9223372036854775808}, "top_k"),
        ({"n": 2, "seed": 18446744073709551615}, "seed"),  # the second sample's seed overflows
        ({"min_tokens": 2**70}, "min_tokens"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"logit_bias": {"5": 1e300}}, "logit_bias"),
        ({"logit_bias": {"99999999999999999999999": 1}}, "logit_bias"),
        ({"temperature": 1e39}, "temperature"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        # fuzzing: bodies this large reached the engine core, which spent seconds receiving them
        ({"logit_bias": {str(t): 1 for t in range(50250, 60000)}}, "logit_bias"),
        ({"stop_token_ids": [0] * 50258}, "stop_token_ids"),  # one more than the vocabulary
    ],
)
def test_out_of_range_numbers_are_400_naming_the_param(server, body, param):
    url, _ = server
    path = "/v1/chat/completions" if "top_logprobs" in body else "/v1/completions"
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body
    if path == "/v1/completions":
        payload = {"prompt": "hello", "max_tokens": 4} | body
    assert_openai_error(httpx.post(f"{url}{path}", json=payload), 400, param)
    assert_still_serving(url)


def test_a_request_failing_in_the_engine_fails_alone(server, gate):
    """The injected fault stands for any attributable bug: one 500, the neighbours finish, the loop goes on."""
    url, _ = server
    body = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
        gate.hold()
        gate.step(2)  # the neighbour's first tokens, then it waits: it is running when the fault hits
        with http.stream("POST", f"{url}/v1/completions", json=body) as neighbour:
            lines = neighbour.iter_lines()
            next(lines)
            faulty = NORMAL | {"seed": FAULT_SEED, "n": 3}
            future = pool.submit(http.post, f"{url}/v1/completions", json=faulty)
            gate.wait_held(2)  # the neighbour and the faulty request have reached the core
            gate.open()  # the next step admits it and fails
            failed = future.result(timeout=60)
            error = assert_openai_error(failed, 500, fragment="request id req-")
            assert error["type"] == "internal_error"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        streamed = http.post(
            f"{url}/v1/completions", json=NORMAL | {"seed": FAULT_SEED, "stream": True}
        )
        events = sse_events(streamed)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "internal_error"
    debug = wait_until(
        lambda: (d := httpx.get(f"{url}/debug/engine").json())["num_requests"] == 0 and d
    )
    assert debug["num_free_blocks"] == debug["num_blocks"] and debug["invariants"] == "ok"
    assert_still_serving(url)


def test_newcomers_sharing_a_failing_step_are_retried_one_by_one(server, gate):
    """Several requests admitted in the step that fails: only the culprit fails; the others complete.
    The engine is held until all four have reached it, so they share one step."""
    url, _ = server
    bodies = [NORMAL | {"seed": 7 + i} for i in range(3)] + [NORMAL | {"seed": FAULT_SEED}]
    with httpx.Client(timeout=60) as http, ThreadPoolExecutor(4) as pool, gate.held():
        futures = [pool.submit(http.post, f"{url}/v1/completions", json=b) for b in bodies]
        gate.wait_held(4)
        gate.open()
        responses = [f.result(timeout=60) for f in futures]
    assert [r.status_code for r in responses] == [200, 200, 200, 500]
    assert_still_serving(url)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "ab\ud800cd"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "x\udc00"]}, "prompt[1]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "us\ud800er", "content": "a"}]},
         "messages[0].role"),
        ("/tokenize", {"prompt": "ab\ud800cd"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]},
         "messages[0].content"),
        ("/v1/completions", {"model": "m\ud800", "prompt": "hi"}, "model"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_400(server, path, body, param):
    url, _ = server
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a \\ud800 escape
    response = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param, "surrogate")
    assert_still_serving(url)


def test_an_emoji_as_a_surrogate_pair_is_fine(server):
    url, _ = server
    raw = json.dumps({"prompt": "smile \U0001f600", "max_tokens": 2})
    assert "\\ud83d\\ude00" in raw
    response = httpx.post(
        f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200


@pytest.mark.parametrize(
    "method, path, content, status, fragment",
    [
        ("POST", "/tokenize", b'{"messages": []}', 400, "messages"),
        ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        ("POST", "/v1/completions", b'{"prompt": "hi",', 400, "not valid JSON"),
        ("POST", "/v1/completions", b"[" * 100 + b"]" * 100, 400, "nests JSON 100 levels"),
        # fuzzing: an unclosed string of escaped quotes took the depth check quadratic time
        # (12 s for 48 KB, the whole server stalled); this body (180 KB) took minutes
        ("POST", "/v1/completions", b"[" * 65 + b'"' + b'\\"' * 90_000, 400,
         "nests JSON 65 levels"),
        # fuzzing: ids past int64 could not be sent to the engine core: a 500
        ("POST", "/v1/completions", b'{"prompt": [18446744073709551616], "max_tokens": 2}', 400,
         "outside the vocabulary"),
        ("POST", "/v1/completions", b'{"prompt": [[1, 2], [-9223372036854775809]]}', 400,
         "outside the vocabulary"),
        ("POST", "/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "boolean"),
        ("POST", "/v1/completions", b'{"prompt": "hi", "top_p": true}', 400, "number"),
        ("POST", "/v1/completions", b'{"prompt": "hi", "n": 2.0}', 400, "integer"),
        ("POST", "/v1/completions", b'{"prompt": "hi", "echo": true}', 400, "echo"),
        ("POST", "/v1/completions", b'{"prompt": "hi", "guided_choice": []}', 400, "guided_choice"),
        ("PUT", "/v1/completions", b"{}", 405, "not allowed"),
        ("GET", "/v1/nothing", b"", 404, "no route"),
        ("POST", "/v1/completions", b'{"prompt": "hi", "n": 17}', 400, "--max-n"),
        ("POST", "/v1/completions", json.dumps({"prompt": "hi", "stop": ["x"] * 17}).encode(),
         400, "at most 16 stop strings"),
        ("POST", "/v1/completions", json.dumps({"prompt": "hi", "stop": ["x" * 257]}).encode(),
         400, "at most 256 characters"),
        ("POST", "/v1/completions", b'{"prompt": ["a", "b", "c"], "n": 11}', 400, "--max-waiting"),
        # issue 46: 6 KB that queued 16,000 samples and held the server for 99 s
        ("POST", "/v1/completions",
         json.dumps({"prompt": ["hi"] * 1000, "n": 16, "max_tokens": 4}).encode(), 400,
         "1000 prompt(s) x n=16 = 16000 samples; this server takes at most 256"),
        ("POST", "/v1/completions", json.dumps({"prompt": ["a"] * 20, "max_tokens": 250}).encode(),
         400, "20 sample(s) x 250 tokens (max_tokens) = 5000 tokens of work"),
        # a max_tokens past the context counts as the context (the context check refuses it alone)
        ("POST", "/v1/completions", json.dumps({"prompt": ["a"] * 17, "max_tokens": 9999}).encode(),
         400, "17 sample(s) x 256 tokens (max_tokens) = 4352 tokens of work"),
    ],
)  # fmt: skip
def test_every_error_is_openai_shaped(server, method, path, content, status, fragment):
    url, _ = server
    response = httpx.request(
        method, f"{url}{path}", content=content, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, status, fragment=fragment)
    assert_still_serving(url)


def test_body_over_the_limit_is_413_declared_or_chunked(server):
    url, _ = server
    big = json.dumps({"prompt": "x" * (MAX_BYTES + 10)}).encode()
    declared = httpx.post(
        f"{url}/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    error = assert_openai_error(declared, 413, fragment="--max-request-bytes")
    assert error["code"] == "request_too_large"

    def chunks():
        for start in range(0, len(big), 65536):
            yield big[start : start + 65536]

    chunked = httpx.post(
        f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_openai_error(chunked, 413, fragment="--max-request-bytes")
    assert_still_serving(url)


def test_a_large_prompt_under_the_limit_is_served(server):
    url, _ = server
    # 30 kB: too few characters to show it cannot fit (GPT-2's longest token covers 128), so it is
    # tokenised in the worker pool (6,001 tokens) and the engine's context check refuses it
    text = "word " * 6_000
    response = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 2})
    error = assert_openai_error(response, 400, "prompt", "the prompt has 6001 tokens")
    assert error["code"] == "context_length_exceeded"
    assert_still_serving(url)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "word " * 30_000, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", "word " * 30_000]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 30_000}]},
            "messages",
        ),
    ],
)
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenised(server, path, body, param):
    """150 kB of text needs at least 150,000 / 128 tokens (128: GPT-2's longest token), far past the
    context of 256: refused from its length (kvserve/server/token_bound.py). A 7 MB prompt took 8 s
    of a worker to tokenise before the engine's check refused it."""
    url, _ = server
    response = httpx.post(f"{url}{path}", json=body)
    error = assert_openai_error(
        response, 400, param, "the prompt has at least 117"
    )  # 1172 + template
    assert error["code"] == "context_length_exceeded"
    # 20,000 characters: at least 157 tokens, which fit alone but not with 250 more
    body = {"prompt": "word " * 4_000, "max_tokens": 250}
    response = httpx.post(f"{url}/v1/completions", json=body)
    error = assert_openai_error(response, 400, "max_tokens", "prompt (at least 157 tokens")
    assert error["code"] == "context_length_exceeded"
    # fuzzing: a short chat with a huge max_tokens said "prompt (at least 0 tokens ...)"; the engine's
    # exact count now
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    error = assert_openai_error(response, 400, "max_tokens", "+ max_tokens (100000)")
    assert "at least" not in error["message"]
    assert_still_serving(url)


def test_tokenize_routes_refuse_what_cannot_fit_the_context(server):
    """fuzzing: /tokenize had no length bound (a 2 MB text took 5.6 s of a worker). It applies the
    prompts' bound, with no room for output: 150 kB needs at least 1172 tokens (150,000 / 128)."""
    url, _ = server
    text = "word " * 30_000
    for body, param in [
        ({"prompt": text}, "prompt"),
        ({"messages": [{"role": "user", "content": text}]}, "messages"),
    ]:
        response = httpx.post(f"{url}/tokenize", json=body)
        error = assert_openai_error(response, 400, param, "the prompt has at least 117")
        assert error["code"] == "context_length_exceeded", error
        assert "no room for output" not in error["message"]
    # what the bound cannot refuse is tokenised, its count past the context (256) included, as vLLM
    counted = httpx.post(f"{url}/tokenize", json={"prompt": "word " * 6_000})
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == 6001 and counted.json()["max_model_len"] == 256
    # /detokenize takes back what /tokenize gave (review: it refused more ids than the context),
    # and no more than /tokenize can give: 256 x 128
    back = httpx.post(f"{url}/detokenize", json={"tokens": counted.json()["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].count("word") == 6000
    assert httpx.post(f"{url}/detokenize", json={"tokens": [995] * 32_768}).status_code == 200
    response = httpx.post(f"{url}/detokenize", json={"tokens": [995] * 32_769})
    error = assert_openai_error(response, 400, "tokens", "32769 token ids")
    assert error["code"] == "context_length_exceeded"
    assert_still_serving(url)


def test_disconnected_non_streaming_request_is_logged_and_query_strings_are_not(server, gate):
    url, log = server
    assert httpx.get(f"{url}/health?note=hunter2-secret").status_code == 200
    body = json.dumps({"prompt": "A long story:", "max_tokens": 200, "ignore_eos": True})
    with gate.held(), socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        gate.step(1)  # then held: the request is unfinished when its client leaves
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert wait_until(lambda: httpx.get(f"{url}/ready").json()["num_unfinished"] == 1)
        sock.close()
        # closed: the server notices, aborts, and logs the request as client_closed_request
        assert wait_until(lambda: httpx.get(f"{url}/ready").json()["num_unfinished"] == 0)
    assert wait_until(lambda: "client_closed_request" in log.read_text())
    text = log.read_text()
    record = [line for line in text.splitlines() if '"client_closed_request"' in line][-1]
    assert '"stream": false' in record
    assert "hunter2-secret" not in text and "GET /health?[query omitted]" in text
    assert_still_serving(url)


def test_unexpected_exception_is_a_json_500_with_a_request_id(caplog):
    """A bug in a route (simulated by one that raises) answers JSON, never text/plain, and logs the
    traceback under the same request id."""
    from fastapi.testclient import TestClient

    from kvserve.server.app import build_app
    from kvserve.server.serving import ServingOptions

    app = build_app(lambda: None, ServingOptions(served_model_name="m"))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret internal detail")

    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: no model is loaded
    error = assert_openai_error(client.get("/boom"), 500, fragment="request id req-")
    assert error["type"] == "internal_error" and "secret internal detail" not in error["message"]
    request_id = error["message"].rsplit("request id ", 1)[1].rstrip(")")
    assert request_id in caplog.text and "secret internal detail" in caplog.text
