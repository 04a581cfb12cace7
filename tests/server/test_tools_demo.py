"""tool_choice "required" on the demo model, without max_tokens (issue 46): the demo model never
chooses EOS after a call, so the call list used to grow until the context was full (finish_reason
length, tool_calls null). Forced parallel calls are now at most DEFAULT_MAX_PARALLEL_CALLS (--max-parallel-tool-calls), so the grammar
ends and the response carries the parsed calls with finish_reason "tool_calls"."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kvserve.server.tool_parsers import DEFAULT_MAX_PARALLEL_CALLS
from tests import FIXTURES
from tests.server_utils import running_server

pytestmark = pytest.mark.slow

TEMPLATE = FIXTURES / "hermes_tools_template.jinja"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


@pytest.fixture(scope="module")
def url():
    args = ("--chat-template", str(TEMPLATE), "--kv-cache-memory", "64MiB")
    with running_server("kvserve-demo", *args) as (base_url, _):
        yield base_url


def test_required_without_max_tokens_ends_after_the_calls(url):
    body = {"model": "kvserve-demo", "tools": TOOLS, "tool_choice": "required",
            "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}]}  # fmt: skip
    for seed in range(4):  # seed 1 called until the context was full, with no call returned
        reply = httpx.post(f"{url}/v1/chat/completions", json=body | {"seed": seed, "temperature": 1},
                           timeout=300).json()  # fmt: skip
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (seed, choice, reply["usage"])
        calls = choice["message"]["tool_calls"]
        assert 1 <= len(calls) <= DEFAULT_MAX_PARALLEL_CALLS, calls
        for call in calls:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
        assert reply["usage"]["total_tokens"] < 512  # ended well before the demo's context
