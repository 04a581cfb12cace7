"""OpenAI request schemas (pydantic) and their mapping to `SamplingParams`.

Every field is implemented or refused: an OpenAI field kvserve does not implement, or a field nobody
defines, is a 400 naming it (`openai_fields`, docs/tools.md), never silently dropped.
Known fields are strict: `"stream": "yes"`, `"top_p": true` or `"n": 2.0` are 400s, not coerced. The
schema's numeric bounds are the ranges the engine accepts (docs/server.md, "Limits").
Extensions beyond OpenAI's parameters follow vLLM's names so clients can switch: top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens, cache_salt.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.core.errors import InvalidRequestError
from kvserve.core.sampling_params import (
    INT64_MAX,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    StructuredOutput,
)
from kvserve.server.tools import ToolPlan, plan_tools, template_message

_STRICT = ConfigDict(extra="allow", strict=True)


class _Request(BaseModel):
    """A request body: extras pass through pydantic and are refused by name (openai_fields); a null counts
    as absent (OpenAI's schema makes most fields nullable, and clients that write every field send
    `"n": null`), so a field that cannot be None takes its default. A field that can keeps the None, which
    may mean something else than its default (`max_tokens: null` on completions: up to the context, not 16)."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None
            or key not in fields
            or fields[key].is_required()
            or type(None) in typing.get_args(fields[key].annotation)
        }


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = (
        False  # vLLM's: usage in every chunk, so clients can count tokens
    )


class _SamplingRequest(_Request):
    # Ranges are documented in the schema (json_schema_extra) and enforced by SamplingParams, whose
    # messages name the accepted range (a 400 with `param`).

    model: str | None = None
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": INT64_MAX})
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    stop: str | list[str] | None = None
    seed: int | None = Field(None, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX})
    presence_penalty: float = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    frequency_penalty: float = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # recorded in the request log, like safety_identifier
    safety_identifier: str | None = None
    # extensions
    top_k: int | None = Field(None, json_schema_extra={"minimum": -1, "maximum": INT64_MAX})
    min_p: float = Field(0.0, json_schema_extra={"minimum": 0, "maximum": 1})
    repetition_penalty: float = Field(1.0, json_schema_extra={"exclusiveMinimum": 0})
    ignore_eos: bool = False
    min_tokens: int = Field(0, json_schema_extra={"minimum": 0, "maximum": INT64_MAX})
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    speculate: bool = True  # kvserve: turn speculative decoding off for this request
    # Structured output: OpenAI's response_format, and vLLM's names (structured_outputs and the older
    # guided_json / guided_regex / guided_choice / guided_grammar) so clients can switch.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        found: list[StructuredOutput] = []
        if self.response_format is not None:
            constraint = _response_format(self.response_format)
            if constraint is not None:
                found.append(constraint)
        so = dict(self.structured_outputs or {})
        legacy = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        for key, value in legacy.items():
            if value is not None:
                so.setdefault(key, value)
        for key, value in so.items():
            param = f"structured_outputs.{key}"
            # a JSON boolean, stricter than vLLM's coercion ("yes", 5, [1] or 0 must not turn it on)
            if key == "json_object" and value is not None and not isinstance(value, bool):
                raise InvalidRequestError("json_object must be a boolean", param)
            if value is None or value is False:
                continue
            if key == "json":
                schema = value if isinstance(value, str) else json.dumps(value)
                found.append(StructuredOutput("json_schema", schema, param))
            elif key == "json_object":
                found.append(StructuredOutput("json_object", "", param))
            elif key in ("regex", "grammar"):
                if not isinstance(value, str):  # never a number taken as its str()
                    raise InvalidRequestError(f"{key} must be a string", param)
                found.append(StructuredOutput(key, value, param))
            elif key == "choice":
                if (
                    not isinstance(value, list)
                    or not value
                    or not all(isinstance(c, str) for c in value)
                ):
                    raise InvalidRequestError("choice must be a non-empty list of strings", param)
                found.append(StructuredOutput("choice", json.dumps(value), param))
            else:
                raise InvalidRequestError(
                    f"unsupported structured output {key!r} (json, json_object, regex, choice, grammar)",
                    "structured_outputs",
                )
        if len(found) > 1:
            raise InvalidRequestError(
                "give one structured-output constraint, not several", found[1].param
            )
        return found[0] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: int() also took " 13 ", "1_3" and other scripts' digits as 13
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                )
            bias[int(key)] = value
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            speculate=self.speculate,
            structured=self.structured_output(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant messages (docs/tools.md)
    tool_call_id: str | None = None  # tool messages


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 1, "maximum": INT64_MAX})
    max_completion_tokens: int | None = Field(
        None, json_schema_extra={"minimum": 1, "maximum": INT64_MAX}
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan | None:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )  # its errors name max_completion_tokens when the client sent that (OpenAIServing.chat_job)
        return self.sampling_params(max_tokens, num_logprobs)

    def rendered_messages(self) -> list[dict[str, Any]]:
        messages = []
        for index, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                parts = []
                for part in content:
                    if part.get("type") != "text":
                        raise InvalidRequestError(
                            f"content part type {part.get('type')!r} is not supported (text only)",
                            "messages",
                        )
                    parts.append(part.get("text", ""))
                content = "".join(parts)
            messages.append(template_message(message, content or "", index))
        return messages


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, json_schema_extra={"minimum": 1, "maximum": INT64_MAX})
    logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 20})
    # Not served (it needs prompt logprobs); the schema says so rather than refusing a valid request.
    echo: bool = Field(
        False, description="not supported: must be false", json_schema_extra={"enum": [False]}
    )

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError(
                "echo is not supported (it needs the prompt's log probabilities)", "echo"
            )
        return self.sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [_token_ids(prompt)]
        return [p if isinstance(p, str) else _token_ids(p) for p in prompt]


def _token_ids(ids: list[int]) -> list[int]:
    """A prompt's token ids; ids that no vocabulary holds (negative, or past int64, which the
    engine core's messages cannot carry) are refused here, the rest where the vocabulary is
    known (EngineCore.validate)."""
    bad = [t for t in ids if not 0 <= t <= INT64_MAX]
    if bad:
        raise InvalidRequestError(
            f"prompt contains token ids outside the vocabulary: {bad[:5]}", "prompt"
        )
    return list(ids)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length", "abort"]


def _response_format(response_format: dict[str, Any]) -> StructuredOutput | None:
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "", "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError(
                'response_format json_schema needs {"json_schema": {"name", "schema"}}',
                "response_format.json_schema",
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):  # as tools' function.strict
            raise InvalidRequestError(
                "json_schema.strict must be a boolean", "response_format.json_schema.strict"
            )
        schema = spec["schema"]
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("json_schema.schema must be a JSON object", "response_format")
        return StructuredOutput("json_schema", json.dumps(schema), "response_format.json_schema")
    raise InvalidRequestError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        "response_format.type",
    )
