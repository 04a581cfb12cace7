"""Sampling parameters of one request: frozen and validated on construction."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from kvserve.core.errors import InvalidRequestError
from kvserve.core.options import option

# Greedy below this temperature (vLLM uses the same epsilon): dividing by ~0 overflows.
_GREEDY_EPS = 1e-5


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")

# The ranges the consumers accept (docs/server.md, "Limits"): seeds go to torch.Generator.manual_seed, which
# takes [-2^63, 2^64 - 1] (sample i of n uses seed + i, so the last one must fit too); integer knobs that
# become int64 tensors must fit int64; float knobs that become float32 tensors must be finite in float32.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


# The default of EngineConfig.grammar_compile_timeout_s (`--grammar-compile-timeout`), here so that the
# API process, which never imports the engine's configuration, knows it before a core reports its own.
GRAMMAR_COMPILE_TIMEOUT_S = 60.0


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

    The fields declared with `option()` are `kvserve generate`'s sampling flags (kvserve/core/options.py;
    the declaration is field metadata only: construction and `_validate` do not read it). Their bounds
    restate what `_validate` enforces, so that a flag is refused naming itself before the model loads;
    tests/cli/test_generate_flags.py holds the two to the same values.
    """

    n: int = 1
    max_tokens: int | None = option(16, "most tokens to generate", ge=1)
    min_tokens: int = 0
    temperature: float = option(1.0, "sampling temperature; 0 is greedy", ge=0)
    top_k: int = option(0, "keep the k likeliest tokens (0 or -1: all)", ge=-1)
    top_p: float = option(
        1.0, "nucleus sampling: keep the likeliest tokens up to this mass", gt=0, le=1
    )
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # --seed is the engine's seed; the range depends on n, so `_validate` alone checks it
    seed: int | None = option(None, "per-request sampling seed", flag="--sample-seed")
    logprobs: int | None = None
    ignore_eos: bool = option(False, "keep going past EOS")
    stop: tuple[str, ...] = option((), "stop string, never emitted (repeatable)")
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    speculate: bool = True  # use the engine's speculative decoding for this request, if it has one
    # False: token ids only, no text (no detokenisation on the engine's clock, e.g. a latency bench)
    detokenize: bool = True
    structured: StructuredOutput | None = None  # constrain the output to a grammar

    def __post_init__(self) -> None:
        # Accept lists/dicts from callers but store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not _int(t) for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be integers", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple((int(t), float(b)) for t, b in bias)
        except (TypeError, ValueError, OverflowError):
            raise InvalidRequestError(
                "logit_bias maps token ids to numbers in [-100, 100]", "logit_bias"
            ) from None
        object.__setattr__(self, "logit_bias", bias)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if not _int(self.n) or not 1 <= self.n <= INT64_MAX:
            raise bad("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (
            not _int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX
        ):
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise bad("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if not _finite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not _int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise bad(
                "top_k",
                f"top_k must be an integer >= 1 (at most 2^63 - 1), or 0 / -1 to disable; "
                f"got {self.top_k!r}",
            )
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= FLOAT32_MAX:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise bad(name, f"{name} must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and (not _int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None:
            if not _int(self.seed):
                raise bad("seed", f"seed must be an integer, got {self.seed!r}")
            if not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
                limit = "2^64 - 1" if self.n == 1 else f"2^64 - 1 - (n - 1) = 2^64 - {self.n}"
                raise bad(
                    "seed",
                    f"seed must be in [-2^63, {limit}] (sample i of n uses seed + i), "
                    f"got {self.seed}",
                )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise bad("stop", "stop strings are matched in the text: they need detokenize=True")
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be in [0, 2^63 - 1]")
        for token_id, bias in self.logit_bias:
            if not _finite(bias) or not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r}")
            if not 0 <= token_id <= INT64_MAX:
                raise bad("logit_bias", f"logit_bias token id must be >= 0, got {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def check_vocabulary(self, vocab_size: int) -> None:
        """The logit_bias ids must lie in the model's vocabulary (known only where the model is)."""
        if any(t >= vocab_size for t, _ in self.logit_bias):
            raise InvalidRequestError(
                f"logit_bias names token ids >= vocab size {vocab_size}", "logit_bias"
            )

    def with_seed(self, seed: int) -> SamplingParams:
        """A copy with another seed, not validated again: sample i of n takes seed + i, which `_validate`
        has checked for every i (re-validating a full-vocabulary logit_bias per sample cost ~80 ms)."""
        return self._copy(seed=seed)

    def without_structured(self) -> SamplingParams:
        """A copy without the output constraint (valid: nothing else changes)."""
        return self._copy(structured=None)

    def _copy(self, **changes) -> SamplingParams:
        clone = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(clone, name, value)
        return clone

    def with_updates(self, **changes) -> SamplingParams:
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        fields.update(changes)
        return SamplingParams(**fields)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
