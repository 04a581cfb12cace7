"""The OpenAI-compatible server, live on 127.0.0.1, against the offline API, the `openai` client and raw
HTTP framing."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from tests.faults import FaultGate
from tests.server_utils import running_server, sse_events, wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-gpt2-llama"
MESSAGES = [{"role": "user", "content": "Write one line about the sea."}]


@pytest.fixture(scope="module")
def gate():
    """Open unless a test holds it: the disconnect tests hold the engine so they never lose a race."""
    with FaultGate() as gate:
        yield gate


@pytest.fixture(scope="module")
def server(gpt2_model_dir, tmp_path_factory, gate):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(
        gpt2_model_dir,
        "--served-model-name",
        MODEL,
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "512",
        "--inject-fault",
        gate.spec(),
        log_path=log,
    ) as (base_url, _):
        yield base_url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(gpt2_model_dir):
    return LLM(str(gpt2_model_dir), kv_cache_memory_bytes=64 * 1024**2, max_model_len=512)


def chat_prompt_ids(offline: LLM) -> list[int]:
    text = offline.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    return offline.tokenizer.encode(text, add_special_tokens=False)


def metric_values(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base_url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_chat_matches_offline_and_stream_matches_non_stream(client, offline):
    expected = offline.generate(
        [chat_prompt_ids(offline)], SamplingParams(max_tokens=12, temperature=0)
    )[0]
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert (
        response.usage.total_tokens
        == response.usage.prompt_tokens + response.usage.completion_tokens
    )
    assert response.system_fingerprint.startswith("fp_")

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks), "no usage chunk unless asked for"
    assert {c.system_fingerprint for c in chunks} == {response.system_fingerprint}


def test_completions_match_offline_for_text_list_and_ids(client, offline):
    params = SamplingParams(max_tokens=10, temperature=0)
    prompts = ["The quick brown fox", "Once upon a time"]
    expected = offline.generate(prompts, params)
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    by_ids = client.completions.create(
        model=MODEL, prompt=expected[0].prompt_token_ids, max_tokens=10, temperature=0
    )
    assert by_ids.choices[0].text == expected[0].outputs[0].text


def test_sse_framing_and_include_usage(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        plain = sse_events(http.post(f"{server}/v1/completions", json=body))
        with_usage = sse_events(
            http.post(
                f"{server}/v1/completions", json={**body, "stream_options": {"include_usage": True}}
            )
        )
        non_stream = http.post(f"{server}/v1/completions", json={**body, "stream": False}).json()
    for events in (plain, with_usage):
        assert events[-1] == "[DONE]"
        assert events.count("[DONE]") == 1
    plain_chunks = [json.loads(e) for e in plain[:-1]]
    assert all("usage" not in c for c in plain_chunks)
    usage_chunks = [json.loads(e) for e in with_usage[:-1]]
    final = usage_chunks[-1]
    assert final["choices"] == [] and final["usage"] == non_stream["usage"]
    assert all(c["usage"] is None for c in usage_chunks[:-1])
    text = "".join(ch["text"] for c in usage_chunks[:-1] for ch in c["choices"])
    assert text == non_stream["choices"][0]["text"]
    assert non_stream["usage"]["completion_tokens"] == 6


def test_n_2_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, n=2, seed=11)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.choices[0].message.content != first.choices[1].message.content
    assert first.usage.completion_tokens == second.usage.completion_tokens > 0


def test_logprobs_shapes(client, server):
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    completion = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    )
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset[0] == 0


@pytest.mark.parametrize(
    "path, body, param, fragment",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, "temperature", ">= 0"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 1.5}, "top_p", "(0, 1]"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n", ">= 1"),
        ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
        ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt", "outside the vocabulary"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, "max_tokens", "context of 512"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ("/v1/chat/completions", {"messages": []}, "messages", ""),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "top_logprobs": 2},
            "top_logprobs",
            "logprobs",
        ),
        ("/v1/completions", {"max_tokens": 3}, "prompt", "Field required"),
    ],
)
def test_invalid_parameters_are_400(server, path, body, param, fragment):
    response = httpx.post(f"{server}{path}", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"]


def test_prompt_longer_than_context_says_the_lengths(server):
    response = httpx.post(
        f"{server}/v1/completions", json={"model": MODEL, "prompt": [5] * 600, "max_tokens": 4}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the prompt has 600 tokens")
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model_is_404_and_server_keeps_serving(server, client):
    response = httpx.post(f"{server}/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_models_tokenize_detokenize(server, offline):
    models = httpx.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    tokens = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["tokens"] == offline.tokenizer.encode("Hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(
        f"{server}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}
    ).json()
    assert text["prompt"] == "Hello world"
    chat = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert chat["tokens"] == chat_prompt_ids(offline)


def test_32_concurrent_streams_complete_and_pool_is_free(server):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str]:
        body = {
            "model": MODEL,
            "prompt": f"Request number {i} says",
            "max_tokens": 8 + i % 5,
            "temperature": 0.8,
            "seed": i,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        text, usage = "", None
        async with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    usage = chunk.get("usage") or usage
        return usage["completion_tokens"], text

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    results = asyncio.run(main())
    assert [n for n, _ in results] == [8 + i % 5 for i in range(32)]
    debug = wait_until(
        lambda: (d := httpx.get(f"{server}/debug/engine").json())["num_requests"] == 0 and d
    )
    assert debug["num_free_blocks"] == debug["num_blocks"] and debug["invariants"] == "ok"
    ready = httpx.get(f"{server}/ready").json()
    assert ready["kv_free_blocks"] == ready["kv_total_blocks"] and ready["num_running"] == 0


def test_client_disconnect_aborts_and_frees(server, gate):
    before = metric_values(server)
    body = {
        "model": MODEL,
        "prompt": "A very long story:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with gate.held(), httpx.Client(timeout=60) as http:
        gate.step(10)  # then the engine waits: the stream is running when the client leaves
        with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            received = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 3:
                    break  # leave mid-stream: the connection closes
        # Aborted while held (the abort wakes the held core): no request left, every block free.
        state = wait_until(
            lambda: (d := httpx.get(f"{server}/debug/engine").json())["num_requests"] == 0 and d,
            timeout_s=5,
        )
    assert state, "the disconnected request is still running"
    assert state["num_free_blocks"] == state["num_blocks"]
    after = metric_values(server)
    generated = (
        after[("kvserve_generation_tokens_total", ())]
        - before[("kvserve_generation_tokens_total", ())]
    )
    assert generated <= 10 < 400


def test_metrics_parse_and_count_requests(server, client):
    before = metric_values(server)
    for _ in range(3):
        client.completions.create(
            model=MODEL, prompt="count me", max_tokens=5, extra_body={"ignore_eos": True}
        )
    httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7})
    after = metric_values(server)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("kvserve_request_success_total", (("finish_reason", "length"),)) == 3
    assert delta("kvserve_generation_tokens_total") == 15
    assert delta("kvserve_prompt_tokens_total") == 3 * 2
    assert delta("kvserve_time_to_first_token_seconds_count") == 3
    assert delta("kvserve_e2e_request_latency_seconds_count") == 3
    assert delta("kvserve_inter_token_latency_seconds_count") == 3 * 4
    assert delta("kvserve_request_queue_time_seconds_count") == 3
    assert delta("kvserve_request_errors_total", (("error_type", "invalid_request_error"),)) == 1
    assert ("kvserve_num_requests_running", ()) in after
    assert ("kvserve_kv_cache_usage_ratio", ()) in after
    assert delta("kvserve_prefix_cache_queries_total") >= 3 * 2
    assert ("kvserve_num_preemptions_total", ()) in after


def test_server_reports_queue_time_and_resets_prefix_cache(server):
    body = {"model": MODEL, "prompt": "The same prompt " * 8, "max_tokens": 3, "temperature": 0}
    first = httpx.post(f"{server}/v1/completions", json=body).json()
    assert first["metrics"]["queue_time_s"] >= 0 and first["metrics"]["ttft_s"] > 0
    assert (
        httpx.post(f"{server}/v1/completions", json=body).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        > 0
    )
    assert httpx.post(f"{server}/reset_prefix_cache").json() == {"status": "ok"}
    after = httpx.post(f"{server}/v1/completions", json={**body, "stream": True}).text
    chunks = [json.loads(e[6:]) for e in after.split("\n\n") if e.startswith("data: {")]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]
    assert final["metrics"]["num_cached_tokens"] == 0 and final["metrics"]["queue_time_s"] >= 0


def test_non_streaming_client_disconnect_aborts(server, gate):
    before = metric_values(server)
    body = json.dumps({"model": MODEL, "prompt": "A very long story:", "max_tokens": 450,
                       "ignore_eos": True, "n": 4})  # fmt: skip
    port = int(server.rsplit(":", 1)[1])
    with gate.held(), socket.create_connection(("127.0.0.1", port)) as sock:
        gate.step(1)  # one step (the prompt's) and then the engine waits: 450 tokens cannot finish
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert wait_until(lambda: httpx.get(f"{server}/ready").json()["num_running"] >= 1)
        sock.close()
        state = wait_until(
            lambda: (d := httpx.get(f"{server}/debug/engine").json())["num_requests"] == 0 and d,
            timeout_s=10,
        )
    assert state and state["num_free_blocks"] == state["num_blocks"]
    after = metric_values(server)
    closed = ("kvserve_request_errors_total", (("error_type", "client_closed_request"),))
    length = ("kvserve_request_success_total", (("finish_reason", "length"),))
    assert after.get(closed, 0) - before.get(closed, 0) == 1
    assert after.get(length, 0) == before.get(length, 0), "it ran to the end instead of aborting"
