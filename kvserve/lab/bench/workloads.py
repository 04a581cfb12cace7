"""Workloads: lists of RequestSpec, seeded per request index.

Request i of a workload depends only on (seed, i), never on how many requests were asked for: a
sweep or a longer run shares an identical prefix of requests with a shorter one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.lab.bench.records import BenchError, RequestSpec
from kvserve.lab.bench.text import CONTENT_TYPES, pieces
from kvserve.lab.bench.tokenization import PromptFitter

WORKLOAD_KINDS = ("random", "sharegpt", "shared-prefix")

# Independent random streams per purpose, so changing one distribution does not shift another's
# draws.
_LENGTHS, _TEXT, _PREFIX, _SHUFFLE = 1, 2, 3, 4


def _rng(seed: int, stream: int, index: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, index])


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed N, uniform integers in [low, high], or a lognormal with
    the given median and sigma (of the log), rounded and clipped to [low, high]."""

    kind: str
    a: float  # fixed: value; uniform: low; lognormal: median
    b: float = 0.0  # uniform: high; lognormal: sigma
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise BenchError(f"unknown length distribution {self.kind!r}")
        if self.kind == "fixed" and self.a < 1:
            raise BenchError(f"fixed length must be >= 1, got {self.a}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise BenchError(f"uniform lengths need 1 <= low <= high, got {self.a}, {self.b}")
        if self.kind == "lognormal" and not (0 < self.a < math.inf and 0 <= self.b < math.inf):
            raise BenchError(f"lognormal needs median > 0 and sigma >= 0, got {self.a}, {self.b}")
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise BenchError(f"clip range [{self.low}, {self.high}] is invalid")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """`N`, `fixed:N`, `uniform:LOW:HIGH`, `lognormal:MEDIAN:SIGMA[:LOW:HIGH]`."""
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            kind, nums = parts[0], [float(p) for p in parts[1:]]
            if kind == "fixed" and len(nums) == 1:
                return cls("fixed", int(nums[0]))
            if kind == "uniform" and len(nums) == 2:
                return cls("uniform", int(nums[0]), int(nums[1]))
            if kind == "lognormal" and len(nums) in (2, 4):
                low, high = (int(nums[2]), int(nums[3])) if len(nums) == 4 else (1, None)
                return cls("lognormal", nums[0], nums[1], low, high)
        except ValueError as exc:
            raise BenchError(f"bad length distribution {text!r}: {exc}") from exc
        raise BenchError(
            f"bad length distribution {text!r}: use N, fixed:N, uniform:LOW:HIGH or "
            "lognormal:MEDIAN:SIGMA[:LOW:HIGH]"
        )

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        value = round(math.exp(rng.normal(math.log(self.a), self.b)))
        return max(self.low, min(value, self.high if self.high is not None else value))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:median={self.a:g}:sigma={self.b:g}:clip=[{self.low},{self.high}]"


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send. `output_len` None with sharegpt means each conversation's reference reply
    length."""

    kind: str = "random"
    input_len: LengthDist = LengthDist("fixed", 512)
    output_len: LengthDist | None = LengthDist("fixed", 128)
    content: str = "prose"
    seed: int = 0
    dataset: str | None = None
    prefix_len: int = 512
    num_prefixes: int = 1
    sharegpt_max_prompt_len: int = 1024
    sharegpt_max_total_len: int = 2048
    # The server's context (from /v1/models' max_model_len) and the tokens its chat template or BOS
    # add to a prompt: set by the runner once connected; None: unknown, nothing is clipped.
    max_model_len: int | None = None
    prompt_overhead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise BenchError(f"workload must be one of {WORKLOAD_KINDS}, got {self.kind!r}")
        if self.content not in CONTENT_TYPES:
            raise BenchError(f"content must be one of {CONTENT_TYPES}, got {self.content!r}")
        if self.kind == "sharegpt" and not self.dataset:
            raise BenchError(
                "the sharegpt workload needs --dataset PATH (a ShareGPT-format JSON file)"
            )
        if self.kind != "sharegpt" and self.output_len is None:
            raise BenchError(f"the {self.kind} workload needs an output length distribution")
        if self.prefix_len < 1 or self.num_prefixes < 1:
            raise BenchError("--prefix-len and --num-prefixes must be >= 1")

    def fit_to_context(self, index: int, num_in: int, num_out: int) -> tuple[int, bool]:
        """(prompt content tokens, clipped): the prompt is cut so that template + prompt +
        max_tokens fits the server's context. A request whose output (plus the shared prefix)
        leaves no room for even one prompt token is refused before the run starts."""
        if self.max_model_len is None:
            return num_in, False
        fixed = self.prompt_overhead_tokens + (
            self.prefix_len if self.kind == "shared-prefix" else 0
        )
        room = self.max_model_len - fixed - num_out
        if room < 1:
            what = f"shared prefix {self.prefix_len} + " if self.kind == "shared-prefix" else ""
            raise BenchError(
                f"request {index}: {what}max_tokens {num_out} + {self.prompt_overhead_tokens} "
                f"template tokens leave no room for a prompt in the server's context of "
                f"{self.max_model_len} tokens; lower --output-len"
                + (" or --prefix-len" if what else "")
            )
        return (room, True) if num_in > room else (num_in, False)

    def describe(self) -> dict:
        out = {"kind": self.kind, "content": self.content, "seed": self.seed}
        if self.kind == "sharegpt":
            out |= {
                "dataset": self.dataset,
                "max_prompt_len": self.sharegpt_max_prompt_len,
                "max_total_len": self.sharegpt_max_total_len,
            }
            out["output_len"] = self.output_len.describe() if self.output_len else "reference reply"
            return out
        out |= {"input_len": self.input_len.describe(), "output_len": self.output_len.describe()}
        if self.kind == "shared-prefix":
            out |= {"prefix_len": self.prefix_len, "num_prefixes": self.num_prefixes}
            out["input_len"] = f"prefix {self.prefix_len} + suffix {self.input_len.describe()}"
        if self.max_model_len is not None:
            out |= {
                "server_max_model_len": self.max_model_len,
                "prompt_overhead_tokens": self.prompt_overhead_tokens,
            }
        return out


def build_workload(
    spec: WorkloadSpec,
    num_requests: int,
    fitter: PromptFitter,
    lengths: Sequence[tuple[int | None, int | None]] | None = None,
    start: int = 0,
) -> list[RequestSpec]:
    """Requests start..num_requests-1 (sharegpt: always from 0, as its selection is sequential).
    `lengths[i]` = (input, output) overrides request i's lengths (from a trace)."""
    if spec.kind == "sharegpt":
        return _sharegpt(spec, num_requests, fitter)
    prefixes = _prefixes(spec, fitter) if spec.kind == "shared-prefix" else None
    out = []
    for i in range(start, num_requests):
        rng = _rng(spec.seed, _LENGTHS, i)
        num_in, num_out = spec.input_len.sample(rng), spec.output_len.sample(rng)
        if lengths is not None and i < len(lengths):
            num_in = lengths[i][0] or num_in
            num_out = lengths[i][1] or num_out
        num_in, clipped = spec.fit_to_context(i, num_in, num_out)
        stream = pieces(spec.content, _rng(spec.seed, _TEXT, i))
        if prefixes is None:
            prompt, count = fitter.fit(stream, num_in)
            out.append(RequestSpec(i, prompt, count, num_out, clipped=clipped))
        else:
            group = int(rng.integers(spec.num_prefixes))
            prompt, count = fitter.fit(stream, spec.prefix_len + num_in, prefix=prefixes[group])
            out.append(RequestSpec(i, prompt, count, num_out, group=group, clipped=clipped))
    return out


def _prefixes(spec: WorkloadSpec, fitter: PromptFitter) -> list[str]:
    out = []
    for g in range(spec.num_prefixes):
        text, _ = fitter.fit(pieces(spec.content, _rng(spec.seed, _PREFIX, g)), spec.prefix_len)
        out.append(text)
    return out


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first user turn, the assistant's reply to it) for each usable conversation, in file
    order."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read ShareGPT file {path}: {exc}") from exc
    if not isinstance(data, list):
        raise BenchError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        turns = entry.get("conversations") or entry.get("messages") or []
        if not isinstance(turns, list):  # e.g. {"conversations": 5}
            continue
        turns = [t for t in turns if isinstance(t, dict)]
        roles = [str(t.get("from", t.get("role", ""))).lower() for t in turns]
        texts = [t.get("value", t.get("content")) for t in turns]
        for k in range(len(turns) - 1):
            if roles[k] in ("human", "user") and roles[k + 1] in ("gpt", "assistant", "chatgpt"):
                if isinstance(texts[k], str) and isinstance(texts[k + 1], str):
                    pairs.append((texts[k], texts[k + 1]))
                break
    return pairs


def _sharegpt(spec: WorkloadSpec, num_requests: int, fitter: PromptFitter) -> list[RequestSpec]:
    pairs = load_sharegpt(spec.dataset)
    order = _rng(spec.seed, _SHUFFLE).permutation(len(pairs))
    out: list[RequestSpec] = []
    for j in order:
        if len(out) == num_requests:
            break
        prompt, reply = pairs[int(j)]
        num_in = fitter.counter.count(prompt)
        num_ref = fitter.counter.count(reply)
        # vLLM's filter: drop tiny turns and ones too long for a typical context.
        if num_in < 4 or num_ref < 4 or num_in > spec.sharegpt_max_prompt_len:
            continue
        if num_in + num_ref > spec.sharegpt_max_total_len:
            continue
        i = len(out)
        num_out = (
            spec.output_len.sample(_rng(spec.seed, _LENGTHS, i)) if spec.output_len else num_ref
        )
        if (
            spec.max_model_len is not None
            and num_in + num_out + spec.prompt_overhead_tokens > spec.max_model_len
        ):
            continue  # does not fit the server's context: filtered like vLLM's long turns
        out.append(RequestSpec(i, prompt, num_in, num_out))
    if len(out) < num_requests:
        raise BenchError(
            f"{spec.dataset} has only {len(out)} usable conversations after filtering; "
            f"{num_requests} were asked for"
            + (
                f" (the server's context is {spec.max_model_len} tokens)"
                if spec.max_model_len is not None
                else ""
            )
        )
    return out
