"""Chat templates rendered as `transformers` renders them (`utils/chat_template_utils.py` of
transformers 5), without importing it: the same sandboxed Jinja environment (trim_blocks,
lstrip_blocks, loop controls, the `{% generation %}` tag), the same globals and `tojson` filter, the
same message normalisation (None-valued keys dropped, reasoning fields aliased) and the same
`continue_final_message` cut. tests/tokenizer/test_tokenizer_light.py renders conversations with
both and compares the text."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning is passed under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant-token
    mask; rendering text (no mask) keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without the attribute access of the real type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no path to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                f"{name!r}. Please rename the attribute."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # not Jinja's own filter, which escapes HTML characters
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _message_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) and those nested in them, as dicts."""
    if isinstance(value, Mapping):
        return {key: _message_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_message_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_message_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _message_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _message_dicts(value.model_dump())
    return value


def normalize_messages(conversation: Any) -> list[dict]:
    """Dicts, with the keys whose value is None dropped (templates handle a missing key, not None)."""
    messages = _message_dicts(getattr(conversation, "messages", conversation))
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(
                f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}."
            )
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def plain_data(value: Any) -> Any:
    """What a template may see: JSON-like types only; anything else becomes `<TypeName>`."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    if _is_numpy_scalar(value):  # np.bool_(False) would otherwise be a truthy placeholder
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _is_numpy_scalar(value: Any) -> bool:
    # numpy.generic, without importing numpy
    return any(c.__name__ == "generic" and c.__module__ == "numpy" for c in type(value).__mro__)


def _alias_reasoning(chat: list) -> list:
    aliased = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next(
                (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tag_final_message(chat: list, field: str, template: str) -> str:
    """Append the continue tag to the final message's `field`; returns the text to continue."""
    if (final := chat[-1].get(field)) is None:
        raise ValueError(
            f'continue_final_message is set but the final message has no "{field}" to continue!'
        )
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in the '
            "chat_template"
        )
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!"
        )
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template! This can happen if the chat template deletes portions of "
            "the final message. Please verify the chat template and final message in your chat to "
            f"ensure they are compatible.Final message to continue: {final.strip()}\n"
            f"Rendered chat:\n{rendered}"
        )
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def render(
    conversations: list[list[dict]],
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    chat_template: str | None = None,
    continue_final_message: bool | str = False,
    add_generation_prompt: bool = False,
    **kwargs,
) -> list[str]:
    """transformers' `render_jinja_template` without the assistant mask: one text per conversation.
    `tools` are JSON schemas (transformers also takes Python functions; the server sends schemas)."""
    template = compile_template(chat_template)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError("the light tokenizer takes tools as JSON schemas (dicts)")
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools, documents, kwargs = plain_data(tools), plain_data(documents), plain_data(kwargs)
    rendered = []
    for chat in conversations:
        chat = plain_data(getattr(chat, "messages", chat))
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(
                    "Chat messages should be dicts, dataclasses or pydantic models, but got "
                    f"{message!r}."
                )
        chat = _alias_reasoning(chat)
        final = None
        if continue_final_message:
            if not chat:
                raise ValueError("continue_final_message is set but the conversation is empty!")
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = _tag_final_message(chat, field, chat_template)
        text = template.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        rendered.append(_cut_at_tag(text, final) if final is not None else text)
    return rendered
