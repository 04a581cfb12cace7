"""Cross-layer step types: what the scheduler decides and what the runner returns. Plain frozen data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """Sent to the runner the first time a request is scheduled; it keeps per-request sampling state
    (seeded generator, token history for penalties) until the request id appears in
    `SchedulerOutput.finished_request_ids`. Preemption does not reset that state."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved output limit (proposals never run past it)


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute `token_ids` at positions [start_position, start_position + len(token_ids)) of one request.

    Its block tables travel as a change (core/block_tables.py): the runner keeps each request's tables
    and appends `new_block_ids` (the first group's) and `group_new_block_ids` (a hybrid model's other
    KV groups', kv/groups.py, in group order) at index `block_offset`, the tables' length when it last
    saw them; `block_offset` 0 sends the tables whole (a request the runner holds none for: admitted
    or resumed). `num_released_blocks[g]` is the length of group g's leading run of null entries (a
    sliding window's returned blocks; empty: none anywhere). `sample` is true when the chunk reaches
    the end of the known tokens, so its last position yields the next token.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    new_block_ids: tuple[int, ...]
    sample: bool
    num_output_tokens: int  # output tokens the request had when scheduled (min_tokens, penalties)
    num_spec_tokens: int = 0  # the last num_spec_tokens of token_ids are proposals to verify
    block_offset: int = 0
    group_new_block_ids: tuple[tuple[int, ...], ...] = ()  # groups 1.. of a hybrid model
    num_released_blocks: tuple[int, ...] = ()

    @property
    def new_tables(self) -> tuple[tuple[int, ...], ...]:
        """Every group's new blocks, the first group's (`new_block_ids`) first."""
        return (self.new_block_ids, *self.group_new_block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens this chunk's last position attends to (cached + new)."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decision. `chunks` are in batch order (running requests first, then admitted ones)."""

    new_requests: tuple[NewRequestData, ...]
    chunks: tuple[ScheduledChunk, ...]
    finished_request_ids: tuple[str, ...]  # the runner drops their state
    preempted_request_ids: tuple[str, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log probability, its rank (1 = most likely), and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampledTokens:
    """Tokens a chunk committed: the accepted proposals plus one sampled token (a correction or the bonus).

    `num_accepted` of the chunk's proposals were accepted, so the chunk's last
    `num_spec_tokens - num_accepted` positions were rejected: their cache entries are discarded.
    `spec_token_ids` are new proposals for the next step.
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    num_accepted: int = 0
    spec_token_ids: tuple[int, ...] = ()
    # A fact, not a decision: the request's grammar accepted a complete document with the last of
    # `token_ids` (the tokens after its end are already cut). The scheduler's `update` ends it.
    grammar_ended: bool = False


@dataclass(frozen=True)
class RunnerOutput:
    """Tokens sampled this step, one entry per chunk with `sample=True`."""

    sampled: tuple[SampledTokens, ...]


@dataclass(frozen=True)
class StopStringMatch:
    """A stop string ended a request: it was completed by the `num_tokens`-th of the tokens offered
    to the stop check (those after it are not part of the output)."""

    num_tokens: int
    stop_string: str


# The engine core's stop-string check, called by `Scheduler.update` once per sampled request with the
# tokens it is about to commit and whether a token rule (EOS, stop ids, length, grammar end) already
# ends the request. The core's incremental detokenizer consumes them there (the text is the core's)
# and answers where a stop string ended, if one did. The scheduler stays torch- and tokenizer-free.
StopCheck = Callable[[str, tuple[int, ...], bool], StopStringMatch | None]


@dataclass(frozen=True)
class RequestUpdate:
    """What one step did for one request: tokens appended and, if it ended, why. The scheduler decides
    both, in one place: `finish_reason` ("stop" | "length" | None) and, for a stop, `stop_reason`, the
    stop string, or the EOS or stop token id, that ended it (None for a grammar that ended on another
    token). `new_token_ids` end at the token that ended the request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    num_cached_tokens: int
    num_spec_proposed: int = 0  # proposals verified this step
    num_spec_accepted: int = 0
    grammar_complete: bool = False  # its grammar accepted a complete document (and its stop token)
    stop_reason: str | int | None = None
