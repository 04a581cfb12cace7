"""No silent drops: each OpenAI request field kvserve does not implement, and each unknown field, is a 400
naming it; tools need a template that renders them; the accepted no-op values pass."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_utils import running_server

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(gpt2_model_dir):
    # The fixture's plain template cannot render tools, and no --tool-call-parser is set.
    with running_server(gpt2_model_dir, "--max-model-len", "256", "--kv-cache-memory", "32MiB") as (
        url,
        _,
    ):
        yield url


CHAT_UNSUPPORTED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
    "metadata": {"k": "v"},
    "prompt_cache_key": "k",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "store": True,
    "service_tier": "flex",
    "modalities": ["text", "audio"],
    "stream_options.include_obfuscation": True,
    "top_a": 0.5,  # nobody's parameter
    "best_of": 5,  # fuzzing: a completions field, skipped unchecked on chat too
}
COMPLETION_UNSUPPORTED = {"suffix": "end", "best_of": 3, "echo": True, "mirostat": 2}


def body_for(param: str, value, base: dict) -> dict:
    if param.startswith("stream_options."):
        return base | {"stream": True, "stream_options": {param.split(".", 1)[1]: value}}
    return base | {param: value}


@pytest.mark.parametrize("param", sorted(CHAT_UNSUPPORTED))
def test_unsupported_chat_field_is_400_naming_it(server, param):
    body = body_for(param, CHAT_UNSUPPORTED[param], {"messages": MESSAGES, "max_tokens": 2})
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split(".")[-1] in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("param", sorted(COMPLETION_UNSUPPORTED))
def test_unsupported_completion_field_is_400_naming_it(server, param):
    body = {"prompt": "Hi", "max_tokens": 2, param: COMPLETION_UNSUPPORTED[param]}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_best_of_is_an_integer_equal_to_n(server):
    # fuzzing: best_of true passed as n=1 (True == 1)
    for best_of in (True, 1.0, "1"):
        body = {"prompt": "Hi", "max_tokens": 2, "best_of": best_of}
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, (best_of, response.text)
        assert response.json()["error"]["param"] == "best_of"


def test_accepted_defaults_and_nulls_pass(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, store=False, service_tier="auto",
        modalities=["text"], user="u-1", safety_identifier="s-1",
        extra_body={"audio": None, "top_k": 5},
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")
    done = client.completions.create(model=model, prompt="Hi", max_tokens=2, n=2, best_of=2)
    assert len(done.choices) == 2


def test_tools_need_a_template_that_renders_them(server):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    required = httpx.post(f"{server}/v1/chat/completions", json=body | {"tool_choice": "required"})
    assert required.status_code == 400
    assert required.json()["error"]["param"] == "tools"
    assert "cannot render tools" in required.json()["error"]["message"]
    # auto (the default with tools) needs a parser: without one it would never find a call
    auto = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in auto.json()["error"]["message"]
    # none needs neither: the tools are not rendered and the answer is content
    none = httpx.post(f"{server}/v1/chat/completions", json=body | {"tool_choice": "none"})
    assert none.status_code == 200, none.text
    assert "tool_calls" not in none.json()["choices"][0]["message"]


MESSAGE_UNSUPPORTED = {
    "refusal": "I cannot",
    "audio": {"id": "audio_1"},
    "function_call": {"name": "f", "arguments": "{}"},
    "frobnicate": 1,  # fuzzing: unknown keys in a message were dropped silently
}


@pytest.mark.parametrize("field", sorted(MESSAGE_UNSUPPORTED))
def test_unsupported_message_field_is_400_naming_it(server, field):
    messages = MESSAGES + [{"role": "assistant", "content": "x", field: MESSAGE_UNSUPPORTED[field]}]
    body = {"messages": messages + MESSAGES, "max_tokens": 2}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == f"messages[1].{field}"
    tokenize = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=30)
    assert tokenize.status_code == 400, tokenize.text
    assert tokenize.json()["error"]["param"] == f"messages[1].{field}"


def test_the_clients_own_assistant_message_goes_back_unchanged(server):
    """The official client sends back the message object it was given (with its null fields)."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    history = [*MESSAGES, first.choices[0].message, {"role": "user", "content": "Again"}]
    second = client.chat.completions.create(model=model, messages=history, max_tokens=2)
    assert second.choices[0].finish_reason in ("stop", "length")
    # as api.openai.com returns them (review: `annotations: []` was refused)
    nulls = {"role": "assistant", "content": "x", "refusal": None, "audio": None, "annotations": []}
    body = {"messages": [*MESSAGES, nulls, *MESSAGES], "max_tokens": 2}
    assert httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize(
    "route, body",
    [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})],
)
def test_tokenize_routes_refuse_unknown_fields(server, route, body):
    # fuzzing: /tokenize took any extra key silently
    response = httpx.post(f"{server}{route}", json=body | {"frobnicate": 1}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "frobnicate"
    assert httpx.post(f"{server}{route}", json=body | {"frobnicate": None}).status_code == 200
    if route == "/tokenize":  # vLLM's fields at their defaults pass; other values do not
        defaults = {"return_token_strs": False, "continue_final_message": False}
        assert httpx.post(f"{server}{route}", json=body | defaults).status_code == 200
        refused = httpx.post(f"{server}{route}", json=body | {"return_token_strs": True})
        assert (
            refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_strs"
        )


def test_every_optional_field_may_be_null(server):
    """fuzzing: `"n": null`, `"stream": null`, `"logprobs": null` ... were 400s ("Input should be a valid
    integer"), though OpenAI's schema makes them nullable and a null counts as absent here."""
    from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

    for path, model, base in [
        ("/v1/chat/completions", ChatCompletionRequest, {"messages": MESSAGES}),
        ("/v1/completions", CompletionRequest, {"prompt": "Hi"}),
    ]:
        optional = [name for name, f in model.model_fields.items() if not f.is_required()]
        assert len(optional) > 20
        body = base | dict.fromkeys(optional) | {"max_tokens": 2}
        response = httpx.post(f"{server}{path}", json=body, timeout=30)
        assert response.status_code == 200, (path, response.text)
    # review: a null that means something else than the default keeps its meaning (completions'
    # max_tokens: null is up to the context, not 16)
    body = {"prompt": "Hi", "max_tokens": None, "ignore_eos": True}
    usage = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256  # --max-model-len
    required = httpx.post(f"{server}/v1/completions", json={"prompt": None, "max_tokens": 2})
    assert required.status_code == 400 and required.json()["error"]["param"] == "prompt"


def with_tool_call(arguments) -> list[dict]:
    """MESSAGES, an assistant message calling `f` with these arguments, then MESSAGES again."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}, *MESSAGES]


@pytest.mark.parametrize(
    "path, body, param, fragment",
    [
        # fuzzing, second round: each was accepted, or named the wrong field, or leaked Python internals
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0},
         "max_completion_tokens", "max_completion_tokens must be"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10_000},
         "max_completion_tokens", "max_completion_tokens (10000)"),  # the context check's 400
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": 5}},
         "structured_outputs.regex", "must be a string"),
        ("/v1/completions", {"prompt": "Hi", "guided_grammar": {"root": 1}}, "guided_grammar", ""),
        ("/v1/completions", {"prompt": "Hi", "echo": True}, "echo", "echo is not supported"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {" 13 ": 1}}, "logit_bias", "token ids"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"1_3": 1}}, "logit_bias", "token ids"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"١٣": 1}}, "logit_bias", "token ids"),
        ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs", "may not set 'tokenize'"),
        ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}},
         "chat_template_kwargs", "may not set 'tools'"),
        ("/tokenize", {"prompt": "Hi", "messages": MESSAGES}, "messages", "not both"),
        # fuzzing, third round: any truthy value turned json_object on (0 too)
        *[("/v1/completions", {"prompt": "Hi", "structured_outputs": {"json_object": value}},
           "structured_outputs.json_object", "must be a boolean") for value in ("yes", 5, [1], 0)],
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"}}},
         "response_format.json_schema.strict", "must be a boolean"),
        # fuzzing, third round: arguments that parse, but not to an object, went to the template
        *[(path, {"messages": with_tool_call(arguments)},
           "messages[1].tool_calls[0].function.arguments", "must be a JSON object")
          for path in ("/v1/chat/completions", "/tokenize") for arguments in ("5", "[1, 2]", 5)],
    ],
)  # fmt: skip
def test_malformed_fields_are_400_naming_them(server, path, body, param, fragment):
    body = body if path == "/tokenize" else {"max_tokens": 2} | body
    response = httpx.post(f"{server}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_json_object_flag_and_object_arguments_pass(server):
    """The accepted forms of the fields above: json_object true constrains, false does not; arguments as
    the JSON text of an object, or the object itself."""
    for flag, constrained in ((True, True), (False, False)):
        body = {"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"json_object": flag}}
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert ("structured_output" in response.json()["choices"][0]) is constrained
    counts = {}
    for arguments in ('{"a": 1}', {"a": 1}, None, "", "{}"):  # none (null, ""): {} as in vLLM
        body = {"messages": with_tool_call(arguments)}
        response = httpx.post(f"{server}/tokenize", json=body, timeout=30)
        assert response.status_code == 200, response.text
        counts[str(arguments)] = response.json()["count"]
    assert counts["None"] == counts[""] == counts["{}"]
