"""Tool calling against a live server with the official `openai` client: forced calls (`required`, a
named function) parse and validate against the declared schema on 20 seeded samples, streamed deltas
concatenate to the same call, and a `tool` message round trip renders through the template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.checkpoints import FIXTURES, GPT2_TOKENIZER
from tests.server_utils import running_server

pytestmark = pytest.mark.slow

TEMPLATE = FIXTURES / "hermes_tools_template.jinja"
MODEL = "tiny-tools"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(gpt2_model_dir):
    args = ("--served-model-name", MODEL, "--max-model-len", "512", "--kv-cache-memory", "64MiB",
            "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes")  # fmt: skip
    with running_server(gpt2_model_dir, *args) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def create(client, **kwargs):
    defaults = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=1.0)
    return client.chat.completions.create(**(defaults | kwargs))


def test_required_calls_parse_and_validate_over_20_seeds(client):
    seen = set()
    for seed in range(20):
        choice = create(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
        choice = choice.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, set(SCHEMAS))
        assert not choice.message.content
        seen |= {c.function.name for c in choice.message.tool_calls}
    assert seen == set(SCHEMAS), "sampling should reach both functions"


def test_parallel_required_calls_each_validate(client):
    """With parallel calls on, the grammar allows more calls after each one, up to
    --max-parallel-tool-calls (4); an output cut by max_tokens keeps the calls it completed."""
    counts = []
    for seed in range(6):
        choice = create(client, tool_choice="required", seed=seed, max_tokens=200).choices[0]
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls, set(SCHEMAS))
            counts.append(len(choice.message.tool_calls))
        else:
            assert choice.finish_reason == "length"
            if choice.message.tool_calls:
                check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert counts and max(counts) > 1 and max(counts) <= 4, counts


def test_named_function_calls_validate_over_20_seeds(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(20):
        choice = create(client, tool_choice=named, seed=seed, parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's finish reason for a named tool_choice
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_time"})


def test_single_call_when_parallel_calls_are_off(client):
    for seed in range(5):
        choice = create(client, tool_choice="required", seed=seed, parallel_tool_calls=False)
        assert len(choice.choices[0].message.tool_calls) == 1


def test_streamed_deltas_concatenate_to_the_same_calls(client):
    for seed in range(4):
        kwargs = dict(tool_choice="required", parallel_tool_calls=False, seed=seed)
        whole = create(client, **kwargs).choices[0]
        calls: dict[int, dict] = {}
        finish, content = None, ""
        for chunk in create(client, **kwargs, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and not content.strip()
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_message_round_trip_renders_and_the_next_turn_runs(client):
    first = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   seed=3).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    second = create(client, messages=history, tool_choice="none", max_tokens=8, seed=1)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None
    # The oracle: transformers renders the same history (arguments as an object) through the template.
    tokenizer = AutoTokenizer.from_pretrained(GPT2_TOKENIZER)
    rendered_history = json.loads(json.dumps(history))
    rendered_history[1]["tool_calls"][0]["function"]["arguments"] = json.loads(
        call.function.arguments
    )
    rendered_history[1]["content"] = ""
    text = tokenizer.apply_chat_template(rendered_history, tools=TOOLS, chat_template=TEMPLATE.read_text(),
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert f'<tool_response id="{call.id}">\nSunny, 21 C\n</tool_response>' in text
    assert json.dumps(json.loads(call.function.arguments), ensure_ascii=False) in text
    assert second.usage.prompt_tokens == len(tokenizer.encode(text))
    # auto, with the parser on: the random model writes no call, so the answer is content
    auto = create(client, messages=history, tool_choice="auto", max_tokens=8, seed=2).choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="sometimes"), "tool_choice"),
        # fuzzing: a `function` that is not an object was a 500 (AttributeError)
        (dict(tool_choice={"type": "function", "function": "get_weather"}), "tool_choice"),
        (dict(tool_choice={"type": "function", "function": ["get_weather"]}), "tool_choice"),
        # fuzzing: a trailing newline passed the name pattern ($ matches before it)
        (dict(tools=[{"type": "function", "function": {"name": "f\n"}}]),
         "tools[0].function.name"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
         "tools[0].function.strict"),
        (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]),
         "tools[0].function.name"),
        (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(parallel_tool_calls=True, tools=None), "parallel_tool_calls"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        # a parameter pattern whose lookahead xgrammar would drop from the forced call's grammar
        (dict(tool_choice="required", tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"properties": {"a": {"pattern": "(?!x)."}}}}}]), "tools"),
        # fuzzing: a forced call's arguments came back as a bare string, not JSON
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
         "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_invalid_tool_requests_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kwargs)
    assert info.value.body["param"] == param
