"""Frozen records that cross module boundaries: a prepared request, a streamed event, a finished
request.

All times are seconds on the run clock: `time.perf_counter()` minus the run's origin, so they are
monotonic and comparable within one run. The wall-clock epoch of the origin is in the summary's
metadata.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

OUTCOMES = ("ok", "failed", "rejected", "timeout", "cancelled")
PHASES = ("warmup", "measured")


class BenchError(Exception):
    """A user-facing error in a benchmark's configuration, inputs or target server."""


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class RequestSpec:
    """One prepared request of a workload. `index` is its position; a given seed and index always
    give the same prompt, so runs of different sizes share a prefix of identical requests."""

    index: int
    prompt: str
    num_prompt_tokens: int | None  # content tokens by the bench's tokenizer (None: not counted)
    max_tokens: int
    group: int | None = None  # shared-prefix group, else None
    clipped: bool = False  # the sampled prompt length was cut to fit the server's context

    @property
    def prompt_sha256(self) -> str:
        return sha256_text(self.prompt)


@dataclass(frozen=True)
class StreamEvent:
    """One SSE `data:` event as the client received it.

    num_chars: output text characters it carried; 0 for a role-only, usage-only or finish-only
    event. cum_completion_tokens: the server's running `usage.completion_tokens` when the event
    carried usage. num_logprob_tokens: number of per-token logprob entries when the event carried
    logprobs.
    """

    t_s: float
    num_chars: int
    cum_completion_tokens: int | None = None
    num_logprob_tokens: int | None = None

    def to_json(self) -> list:
        return [
            round(self.t_s, 7),
            self.num_chars,
            self.cum_completion_tokens,
            self.num_logprob_tokens,
        ]

    @classmethod
    def from_json(cls, row: list) -> StreamEvent:
        return cls(float(row[0]), int(row[1]), row[2], row[3])


@dataclass(frozen=True)
class RequestRecord:
    """The raw result of one request: every timestamp and count, never the text (only its hash)."""

    request_id: str
    index: int
    phase: str  # one of PHASES
    outcome: str  # one of OUTCOMES
    t_scheduled_s: float
    t_send_s: float | None  # None: never sent (cancelled while waiting)
    t_end_s: float | None  # stream closed, error, timeout or cancellation
    max_tokens: int
    events: tuple[StreamEvent, ...] = ()
    num_prompt_tokens_client: int | None = None
    num_prompt_tokens_server: int | None = None
    num_completion_tokens_server: int | None = None
    num_completion_tokens_retokenized: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None
    output_sha256: str | None = None
    num_output_chars: int = 0
    system_fingerprint: str | None = None
    queue_time_s: float | None = None
    prompt_sha256: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r} not in {OUTCOMES}")
        if self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r} not in {PHASES}")

    def to_json(self) -> dict:
        out = {
            k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("events", "extra")
        }
        out["events"] = [e.to_json() for e in self.events]
        if self.extra:
            out["extra"] = self.extra
        return out

    @classmethod
    def from_json(cls, obj: dict) -> RequestRecord:
        obj = dict(obj)
        events = tuple(StreamEvent.from_json(r) for r in obj.pop("events", ()))
        known = {k: obj[k] for k in cls.__dataclass_fields__ if k in obj}
        return cls(**known, events=events)


def write_jsonl(path: Path, records: Iterable[RequestRecord]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")


def read_jsonl(path: Path) -> list[RequestRecord]:
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[RequestRecord]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield RequestRecord.from_json(json.loads(line))
