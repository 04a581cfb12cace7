"""kvserve/server/protocol.py: the ranges a request's schema publishes (`json_schema_extra`, what
/openapi.json shows clients) are the ranges `SamplingParams` enforces.

The schema states each sampling field's range for clients; `SamplingParams._validate` refuses what
is outside it with a 400 naming the field. The two are written apart (the schema is JSON, the check
has its own messages), so this holds them together: for every bounded field, the bound itself is
accepted and the nearest value past it is refused, naming that field.
"""

from __future__ import annotations

import math

import pytest

from kvserve.core.errors import InvalidRequestError
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

# request field -> the SamplingParams field its error names (the same but for the chat's aliases)
_PARAM = {"max_completion_tokens": "max_tokens"}
_UNCHECKED = {"top_logprobs"}  # pydantic's own bound (ge/le), refused before SamplingParams


def _bounded_fields(model) -> list[tuple[str, str, float | int]]:
    """(field, bound kind, value) for every bound the model's schema publishes."""
    out = []
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra
        if not isinstance(extra, dict) or name in _UNCHECKED:
            continue
        for kind in ("minimum", "maximum", "exclusiveMinimum"):
            if kind in extra:
                out.append((name, kind, extra[kind]))
    return out


def _past(kind: str, bound, annotation_is_int: bool):
    """The nearest value outside the bound (exclusiveMinimum: the bound itself)."""
    if kind == "exclusiveMinimum":
        return bound
    step = 1 if annotation_is_int else None
    if kind == "minimum":
        return bound - step if step else math.nextafter(float(bound), -math.inf)
    return bound + step if step else math.nextafter(float(bound), math.inf)


def _inside(kind: str, bound, annotation_is_int: bool):
    if kind != "exclusiveMinimum":
        return bound
    return bound + 1 if annotation_is_int else math.nextafter(float(bound), math.inf)


def _is_int(model, name: str) -> bool:
    return "int" in str(model.model_fields[name].annotation)


def _request(model, **fields):
    if model is CompletionRequest:
        return model(prompt="hi", **fields)
    return model(messages=[{"role": "user", "content": "hi"}], **fields)


CASES = [
    (model, name, kind, bound)
    for model in (CompletionRequest, ChatCompletionRequest)
    for name, kind, bound in _bounded_fields(model)
]


def test_every_bounded_sampling_field_is_covered():
    names = {name for _, name, _, _ in CASES}
    assert {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens"} <= names
    assert {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"} <= names


@pytest.mark.parametrize(
    ("model", "name", "kind", "bound"),
    CASES,
    ids=[f"{m.__name__}-{n}-{k}" for m, n, k, _ in CASES],
)
def test_the_published_bound_is_the_enforced_one(model, name, kind, bound):
    is_int = _is_int(model, name)
    inside = _inside(kind, bound, is_int)
    extra = {"max_tokens": max(inside, 1)} if name == "min_tokens" else {}  # min <= max_tokens
    _request(model, **{name: inside, **extra}).to_sampling_params()
    with pytest.raises(InvalidRequestError) as refused:
        _request(model, **{name: _past(kind, bound, is_int)}).to_sampling_params()
    assert refused.value.param in (name, _PARAM.get(name))
