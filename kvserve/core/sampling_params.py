"""Sampling parameters of one request: frozen and validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.core.errors import InvalidRequestError

# Greedy below this temperature (vLLM uses the same epsilon): dividing by ~0 overflows.
_GREEDY_EPS = 1e-5


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: `spec` is the JSON schema text, the regex, a JSON list of choices or
    an EBNF grammar (empty for json_object). `param` names the request field it came from, for errors."""

    kind: str
    spec: str = ""
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}",
                self.param,
            )
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"the {self.kind} constraint is empty", self.param)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `max_tokens=None` means "up to the model's context". `logprobs=k` returns the chosen token's log
    probability and the top-k alternatives (k may be 0) of the model's raw distribution. `stop` strings are
    matched by the detokenizer and never appear in the output text.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    speculate: bool = True  # use the engine's speculative decoding for this request, if it has one
    structured: StructuredOutput | None = None  # constrain the output to a grammar

    def __post_init__(self) -> None:
        # Accept lists/dicts from callers but store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(
                "top_k", f"top_k must be an integer >= 1, or 0 / -1 to disable; got {self.top_k!r}"
            )
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise bad(name, f"{name} must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise bad("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"seed must be an integer, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be >= 0")
        for token_id, bias in self.logit_bias:
            if not _finite(bias) or not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r}")
            if token_id < 0:
                raise bad("logit_bias", f"logit_bias token id must be >= 0, got {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def with_updates(self, **changes) -> SamplingParams:
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        fields.update(changes)
        return SamplingParams(**fields)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
