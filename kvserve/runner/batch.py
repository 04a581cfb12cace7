"""Per-request sampling state, and one step's sampling parameters as tensors (`SamplingBatch`)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.runner.constraints import MaskRow
from kvserve.runner.sampler import SamplingBatch


@dataclass
class RequestState:
    """What the runner remembers of a request between steps (until it finishes; preemption keeps it).

    `output_token_ids` is an input buffer (penalties, proposers), not a second record: the scheduler's
    `Request.output_token_ids` is the one copy. The runner appends what it samples because this step's
    proposals need it before the scheduler commits; each step checks its length against the
    scheduler's count (`ScheduledChunk.num_output_tokens`), so the two cannot drift apart unnoticed
    (tokens past a stop are dropped with the request)."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    draft_num_computed: int = 0  # draft-model cache entries valid for [0, draft_num_computed)
    # q rows [n, V] of the pending proposals (None: point masses)
    draft_probs: torch.Tensor | None = None
    grammar: object | None = None  # xgrammar matcher over committed tokens (constrained requests)
    num_draft_grammar_tokens: int = 0  # proposals accepted into `grammar` while drafting
    json_grammar: bool = False  # `grammar` describes JSON (control-character tokens are banned)

    # Tensors built from the request once, not at every step (a full-vocabulary logit_bias or
    # stop_token_ids list took 0.1-0.5 s of host work per step when rebuilt from Python each time).
    # Sparse, so they hold what the request sent: a step concatenates them in C.
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _stop_ids: torch.Tensor | None = field(default=None, init=False, repr=False)  # [K] long
    _output_ids: torch.Tensor | None = field(default=None, init=False, repr=False)  # buffer, long
    _num_output_ids: int = field(default=0, init=False, repr=False)
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False)  # [P] long

    def __post_init__(self) -> None:
        p = self.params
        # Greedy with nothing that changes the logits or reads them back: the raw argmax is the
        # token (the grammar is set after construction, so it is checked per step).
        self._plain_greedy = (
            p.greedy and not p.logit_bias and not has_penalty(p) and p.logprobs is None
        )
        self._num_banned_outputs = p.min_tokens if (p.stop_token_ids or not p.ignore_eos) else 0

    def plain_greedy(self, num_output: int) -> bool:
        """Whether this row's token is the argmax of its raw logits at `num_output` tokens so far:
        greedy, no bias, penalties, logprobs or grammar, and no min_tokens ban in effect."""
        return (
            self._plain_greedy and self.grammar is None and num_output >= self._num_banned_outputs
        )

    @property
    def token_ids(self) -> list[int]:
        return list(self.prompt_token_ids) + self.output_token_ids

    def bias(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids [B] long, values [B] float32), built on first use."""
        if self._bias is None:
            pairs = np.array(self.params.logit_bias, dtype=np.float64)  # [B, 2]; ids < vocab, exact
            self._bias = (
                torch.from_numpy(pairs[:, 0].astype(np.int64)).to(device),
                torch.from_numpy(pairs[:, 1].astype(np.float32)).to(device),
            )
        return self._bias

    def stop_ids(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """The ids min_tokens holds back [K] long (K may be 0), built on first use."""
        if self._stop_ids is None:
            ids = np.array(stop_token_ids(self, vocab_size), dtype=np.int64)
            self._stop_ids = torch.from_numpy(ids).to(device)
        return self._stop_ids

    def penalty_ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the output's token ids so far [n] long, the prompt's distinct ids [P] long), kept between
        steps: each step converts only the tokens added since the last (the buffer doubles as it fills)."""
        n = len(self.output_token_ids)
        if self._output_ids is None or n < self._num_output_ids:
            self._output_ids = torch.empty(max(64, n), dtype=torch.long, device=device)
            self._num_output_ids = 0
        if n > self._num_output_ids:
            if n > len(self._output_ids):
                grown = torch.empty(
                    max(n, 2 * len(self._output_ids)), dtype=torch.long, device=device
                )
                grown[: self._num_output_ids] = self._output_ids[: self._num_output_ids]
                self._output_ids = grown
            new = self.output_token_ids[self._num_output_ids :]
            self._output_ids[self._num_output_ids : n] = torch.tensor(new, dtype=torch.long)
            self._num_output_ids = n
        if self._prompt_ids is None:
            ids = np.unique(np.array(self.prompt_token_ids, dtype=np.int64))
            self._prompt_ids = torch.from_numpy(ids).to(device)
        return self._output_ids[:n], self._prompt_ids

    @property
    def speculates(self) -> bool:
        # Penalties depend on the tokens before each position; proposals would need per-position counts.
        return self.params.speculate and not has_penalty(self.params)


def build_sampling_batch(
    rows: list[tuple[RequestState, int, int]],
    lookahead: tuple[int, ...],
    vocab_size: int,
    device: torch.device,
    apply_grammar: Callable[[torch.Tensor, list[MaskRow]], None],
) -> SamplingBatch:
    """rows: (state, position offset, output tokens before that row's token) per logits row."""
    states = [state for state, _, _ in rows]
    params = [s.params for s in states]

    def column(values, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    batch = SamplingBatch(
        temperature=column([0.0 if p.greedy else p.temperature for p in params]),
        top_k=column([p.top_k for p in params], torch.long),
        top_p=column([p.top_p for p in params]),
        min_p=column([p.min_p for p in params]),
        generators=[s.generator for s in states],
        num_logprobs=[p.logprobs for p in params],
        host_all_greedy=all(p.greedy for p in params),
        host_random_rows=[row for row, p in enumerate(params) if not p.greedy],
        host_use_top_k=any(p.top_k > 0 for p in params),
        # compared as the float32 values the tensors hold (0.99999999 is 1.0 there)
        host_use_top_p=any(_float32(p.top_p) < 1.0 for p in params),
        host_use_min_p=any(_float32(p.min_p) > 0 for p in params),
    )
    biased = [
        (row, state.bias(device)) for row, state in enumerate(states) if state.params.logit_bias
    ]
    if biased:
        ids = [ids for _, (ids, _) in biased]
        batch.bias = (
            _row_index([row for row, _ in biased], ids, device),
            torch.cat(ids),
            torch.cat([values for _, (_, values) in biased]),
        )
    banned = [
        (row, state.stop_ids(vocab_size, device))
        for row, (state, _, num_output) in enumerate(rows)
        # A grammar decides when its document may end; min_tokens does not override it.
        if num_output < state.params.min_tokens and state.grammar is None
    ]
    banned = [(row, ids) for row, ids in banned if len(ids)]
    if banned:
        ids = [ids for _, ids in banned]
        batch.banned = (_row_index([row for row, _ in banned], ids, device), torch.cat(ids))
    if any(has_penalty(p) for p in params):
        _add_penalties(batch, states, vocab_size, device)
    mask_rows = [
        MaskRow(row, state.grammar, offset, lookahead, state.json_grammar)
        for row, (state, offset, _) in enumerate(rows)
        if state.grammar is not None
    ]
    if mask_rows:
        batch.constrain = lambda logits: apply_grammar(logits, mask_rows)
    return batch


def _row_index(rows: list[int], parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each row number repeated once per element of its part: the row index of `torch.cat(parts)`."""
    counts = torch.tensor([len(part) for part in parts], device=device)
    return torch.tensor(rows, dtype=torch.long, device=device).repeat_interleave(counts)


def _float32(value: float) -> float:
    """`value` rounded to float32, as `torch.tensor(..., dtype=torch.float32)` stores it."""
    return struct.unpack("f", struct.pack("f", value))[0]


def stop_token_ids(state: RequestState, vocab_size: int) -> list[int]:
    ids = set(state.params.stop_token_ids)
    if not state.params.ignore_eos:
        ids |= state.eos_token_ids
    return [t for t in ids if t < vocab_size]


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _add_penalties(
    batch: SamplingBatch, states: list[RequestState], vocab_size: int, device: torch.device
) -> None:
    counts = torch.zeros(len(states), vocab_size, device=device)
    prompt_mask = torch.zeros(len(states), vocab_size, dtype=torch.bool, device=device)
    for row, state in enumerate(states):
        # Rows without a penalty keep zeros: with penalty 1 and 0 their counts change nothing.
        if has_penalty(state.params):
            out, prompt = state.penalty_ids(device)
            counts[row].index_add_(0, out, torch.ones(len(out), device=device))
            if state.params.repetition_penalty != 1.0:
                prompt_mask[row, prompt] = True
    params = [s.params for s in states]
    batch.output_counts = counts
    batch.prompt_mask = prompt_mask
    batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
    batch.host_penalty_below_one = any(p.repetition_penalty < 1.0 for p in params)
    batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
    batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)
