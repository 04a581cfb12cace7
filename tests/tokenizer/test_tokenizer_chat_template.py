"""Chat templates rendered by the light tokenizer (kvserve/tokenizer/chat_template.py) against
transformers' `apply_chat_template`: the same text for the models' own templates, a tool template and
a template that uses every feature transformers gives templates; the same errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvserve.tokenizer import LightTokenizer
from tests import tokenizer_dirs as dirs
from tests.checkpoints import GPT2_TOKENIZER
from tests.real_models import smollm2_gguf

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city — «quoted», ünïcode",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "hi"}],
    "system and turns": [
        {"role": "system", "content": "Be brief. ✓"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?  \n"},
    ],
    "tool call and result": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "☀"}'},
    ],
    "reasoning": [
        {"role": "user", "content": "think"},
        {"role": "assistant", "content": "done", "reasoning": "because"},
        {"role": "user", "content": "again 😀"},
    ],
    "empty content": [{"role": "user", "content": ""}],
}
FEATURES_TEMPLATE = """
{%- set ns = namespace(count=0, seen=[]) -%}
{{ bos_token }}|{{ eos_token }}|{{ pad_token | default('no pad') }}
{% for m in messages %}
  {% if loop.index > 6 %}{% break %}{% endif %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {%- set ns.count = ns.count + 1 %}
<{{ m.role }}>{{ m.content | default('') | trim }}
  {%- if m.tool_calls is defined %}
{{ m.tool_calls | tojson }}
{{ m.tool_calls | tojson(indent=2) }}
{{ m.tool_calls | tojson(separators=(',', ':'), sort_keys=true) }}
  {%- endif %}
  {%- if m.reasoning_content is defined %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}
{% endfor %}
{%- if tools %}{{ tools | tojson }}{% endif %}
{%- if documents %}{{ documents | tojson }}{% endif %}
{{ ns.count }} {{ strftime_now('%Y') }} {{ dict(a=1, b=[2, 'x']) | tojson }} {{ custom | default('-') }}
{% generation %}{% if add_generation_prompt %}<assistant>
{% endif %}{% endgeneration %}"""


def _pairs(tmp_path_factory):
    sources = {
        "demo": dirs.DEMO,
        "gpt2": GPT2_TOKENIZER,
        "llama2_style": dirs.llama2_style(tmp_path_factory.mktemp("l2")),
        "qwen3_style": dirs.qwen3_style(tmp_path_factory.mktemp("q3")),
        "gemma_style": dirs.gemma_style(tmp_path_factory.mktemp("g")),
    }
    return sources


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (light, transformers)."""
    sources = _pairs(tmp_path_factory)
    try:
        from kvserve.gguf.model_dir import gguf_model_dir

        sources["smollm2_gguf"] = gguf_model_dir(smollm2_gguf())
    except pytest.skip.Exception:
        pass
    return {
        name: (LightTokenizer.load(path), AutoTokenizer.from_pretrained(str(path)))
        for name, path in sources.items()
    }


def _both(pair, *args, **kwargs):
    """(light's result or exception, transformers' result or exception)."""
    results = []
    for tokenizer in pair:
        try:
            results.append(tokenizer.apply_chat_template(*args, tokenize=False, **kwargs))
        except Exception as exc:  # noqa: BLE001 (the oracle's error is part of the comparison)
            results.append((type(exc).__name__, str(exc)))
    return results


def test_the_models_own_templates_render_as_in_transformers(tokenizers):
    compared = 0
    for name, pair in tokenizers.items():
        if pair[1].chat_template is None:
            continue
        for title, conversation in CONVERSATIONS.items():
            for add_generation_prompt in (True, False):
                light, hf = _both(pair, conversation, add_generation_prompt=add_generation_prompt)
                assert light == hf, (name, title, add_generation_prompt)
                compared += 1
    assert compared >= 5 * 2 * len(CONVERSATIONS)


@pytest.mark.parametrize("template", ["hermes", "features"])
def test_given_templates_render_as_in_transformers(tokenizers, template):
    source = dirs.HERMES_TEMPLATE if template == "hermes" else FEATURES_TEMPLATE
    for name, pair in tokenizers.items():
        for title, conversation in CONVERSATIONS.items():
            for options in (
                {"add_generation_prompt": True},
                {"add_generation_prompt": False, "tools": TOOLS},
                {"add_generation_prompt": True, "tools": TOOLS, "custom": {"k": "v"}},
                {"documents": [{"title": "T", "text": "doc ✓"}], "padding": True},
            ):
                light, hf = _both(pair, conversation, chat_template=source, **options)
                assert light == hf, (name, title, options)


def test_continue_final_message_cuts_as_in_transformers(tokenizers):
    prefill = [
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "The colour is  "},
    ]
    for name, pair in tokenizers.items():
        for source in (dirs.HERMES_TEMPLATE, FEATURES_TEMPLATE):
            for options in (
                {"continue_final_message": True},
                {"continue_final_message": True, "add_generation_prompt": True},
                {"continue_final_message": "reasoning_content"},
            ):
                light, hf = _both(pair, prefill, chat_template=source, **options)
                assert light == hf, (name, options)


def test_template_errors_are_those_of_transformers(tokenizers):
    pair = tokenizers["llama2_style"]
    out_of_order = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    light, hf = _both(pair, out_of_order)
    assert (
        light
        == hf
        == ("TemplateError", "Conversation roles must alternate user/assistant/user/assistant/...")
    )
    for bad in (
        "{{ ''.__class__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages[0].content.upper.__globals__ }}",
        "{% for %}",
    ):
        light, hf = _both(pair, [{"role": "user", "content": "x"}], chat_template=bad)
        assert light == hf, bad
    light, hf = _both(pair, [])
    assert light == hf and light[0] == "ValueError"
    light, hf = _both(pair, [{"role": "user", "content": "x"}], return_assistant_tokens_mask=True)
    assert light == hf and light[0] == "ValueError"


def test_several_templates_choose_as_transformers_does(tokenizers):
    """gemma_style has chat_template.jinja and additional_chat_templates/tool_use.jinja."""
    light, hf = tokenizers["gemma_style"]
    assert isinstance(light.chat_template, dict) and light.chat_template == hf.chat_template
    conversation = CONVERSATIONS["system and turns"]
    for options in ({}, {"tools": TOOLS}, {"chat_template": "tool_use"}, {"chat_template": "x"}):
        light_text, hf_text = _both((light, hf), conversation, **options)
        assert light_text == hf_text, options
    assert light.get_chat_template(tools=TOOLS) == dirs.HERMES_TEMPLATE


def test_a_template_sees_only_plain_data():
    """Messages arrive as the server builds them (dicts); objects become inert placeholders."""
    light = LightTokenizer.load(dirs.DEMO)
    text = light.apply_chat_template(
        [{"role": "user", "content": "x", "extra": object()}],
        chat_template="{{ messages[0].extra }}",
        tokenize=False,
    )
    assert text == "<object>"
