"""No OpenAI parameter is silently ignored (docs/tools.md): a request field kvserve does not implement is
a 400 that names it, and so is a field nobody defines.

The request models declare every field kvserve implements (OpenAI's and vLLM's extensions); anything else
arrives as a pydantic extra and is checked here. A null value counts as absent, as OpenAI treats it.
"""

from __future__ import annotations

from typing import Any

from kvserve.core.errors import InvalidRequestError

# OpenAI fields with no implementation here, and why (the 400's message).
_NOT_SUPPORTED = {
    "audio": "audio output is not supported (text only)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this server runs no reasoning model; reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "metadata": "kvserve stores no completions, so metadata has nothing to attach to",
    "prompt_cache_key": "prefix caching is automatic; prompt_cache_key is not supported "
    "(cache_salt isolates a tenant's cache)",
    "functions": "`functions` is deprecated and not supported: send `tools`",
    "function_call": "`function_call` is deprecated and not supported: send `tool_choice`",
    "suffix": "suffix (insertion) is not supported",
}
# Fields of an OpenAI chat message that the chat template is not given, and why.
_MESSAGE_NOT_SUPPORTED = {
    "refusal": "a message's `refusal` is not rendered: send the text as `content`",
    "audio": "audio is not supported (text only)",
    "function_call": "`function_call` is deprecated and not supported: send `tool_calls`",
}
# OpenAI fields whose default behaviour is what kvserve does: these values are accepted.
_ACCEPTED_VALUES: dict[str, tuple[Any, ...]] = {
    "store": (False,),  # nothing is stored
    "service_tier": ("auto", "default"),  # one tier
    "modalities": (["text"],),
}
_STREAM_ACCEPTED: dict[str, tuple[Any, ...]] = {"include_obfuscation": (False,)}


def check_fields(request, kind: str) -> None:
    """Raise a 400 for the first field of `request` (chat or completion) that kvserve would ignore."""
    # best_of is a completions field (checked below); a chat request has none
    skip = ("best_of",) if kind == "completion" else ()
    _check_extras(request.model_extra or {}, "", not_supported=_NOT_SUPPORTED, skip=skip)
    check_messages(getattr(request, "messages", None))
    options = getattr(request, "stream_options", None)
    if options is not None:
        _check_extras(options.model_extra or {}, "stream_options.", _STREAM_ACCEPTED)
    if kind == "completion":
        best_of = (request.model_extra or {}).get("best_of")
        if best_of is not None and (type(best_of) is not int or best_of != request.n):
            raise InvalidRequestError(
                "best_of other than n is not supported (it would rank samples by log probability)",
                "best_of",
            )


def check_messages(messages) -> None:
    """A 400 for the first field of a chat message that the template would not see. `annotations`
    (url citations of an answer, which clients replay with the assistant message) is metadata of the
    response, not of the conversation: it passes."""
    for index, message in enumerate(messages or ()):
        extras = message.model_extra or {}
        prefix = f"messages[{index}]."
        _check_extras(extras, prefix, {}, _MESSAGE_NOT_SUPPORTED, skip=("annotations",))


# vLLM's /tokenize fields at their defaults (what kvserve does); other values are refused.
_TOKENIZE_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "return_token_strs": (False,),
    "continue_final_message": (False,),
}


def check_other_fields(request) -> None:
    """`/tokenize` and `/detokenize`: every field they do not define is a 400, as on the others."""
    _check_extras(request.model_extra or {}, "", _TOKENIZE_ACCEPTED)
    check_messages(getattr(request, "messages", None))


def _check_extras(
    extras: dict[str, Any],
    prefix: str,
    accepted: dict[str, tuple[Any, ...]] = _ACCEPTED_VALUES,
    not_supported: dict[str, str] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    for name, value in extras.items():
        param = prefix + name
        if value is None or name in skip:
            continue
        if name in accepted:
            if value in accepted[name]:
                continue
            raise InvalidRequestError(
                f"{param}={value!r} is not supported (accepted: "
                f"{', '.join(repr(v) for v in accepted[name])})",
                param,
            )
        if not_supported and name in not_supported:
            raise InvalidRequestError(f"{param}: {not_supported[name]}", param)
        raise InvalidRequestError(f"unknown parameter {param!r}", param)
