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
    _bias: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] float32
    _stop_mask: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] bool
    _has_stops: bool = field(default=False, init=False, repr=False)
    _counts: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] output counts
    _num_counted: int = field(default=0, init=False, repr=False)
    _prompt_mask: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] bool

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

    def bias_row(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """logit_bias as a dense row [V] float32 (repeated ids add up), built on first use."""
        if self._bias is None:
            pairs = np.array(self.params.logit_bias, dtype=np.float64)  # [B, 2]; ids < vocab, exact
            ids = torch.from_numpy(pairs[:, 0].astype(np.int64)).to(device)
            values = torch.from_numpy(pairs[:, 1].astype(np.float32)).to(device)
            self._bias = torch.zeros(vocab_size, device=device).index_add_(0, ids, values)
        return self._bias

    def stop_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """The ids min_tokens holds back, as a mask [V] bool (None: there are none); built on first use."""
        if self._stop_mask is None:
            ids = np.array(stop_token_ids(self, vocab_size), dtype=np.int64)
            self._stop_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._stop_mask[torch.from_numpy(ids).to(device)] = True
            self._has_stops = len(ids) > 0
        return self._stop_mask if self._has_stops else None

    def penalty_inputs(
        self, vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(occurrences of each token in the output so far [V] float32, token is in the prompt [V] bool),
        kept between steps: each step counts only the tokens added since the last."""
        if self._counts is None or len(self.output_token_ids) < self._num_counted:
            self._counts = torch.zeros(vocab_size, device=device)
            self._num_counted = 0
        new = self.output_token_ids[self._num_counted :]
        if new:
            out = torch.tensor(new, device=device)
            self._counts.index_add_(0, out, torch.ones(len(out), device=device))
            self._num_counted += len(new)
        if self._prompt_mask is None:
            self._prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if self.params.repetition_penalty != 1.0:
                self._prompt_mask[torch.tensor(self.prompt_token_ids, device=device)] = True
        return self._counts, self._prompt_mask

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
    biased = [row for row, p in enumerate(params) if p.logit_bias]
    if biased:
        bias_rows = [states[row].bias_row(vocab_size, device) for row in biased]
        batch.bias = (column(biased, torch.long), torch.stack(bias_rows))
    banned = [
        (row, state.stop_mask(vocab_size, device))
        for row, (state, _, num_output) in enumerate(rows)
        # A grammar decides when its document may end; min_tokens does not override it.
        if num_output < state.params.min_tokens and state.grammar is None
    ]
    banned = [(row, mask) for row, mask in banned if mask is not None]
    if banned:
        masks = torch.stack([mask for _, mask in banned])
        batch.banned = (column([row for row, _ in banned], torch.long), masks)
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
            counts[row], prompt_mask[row] = state.penalty_inputs(vocab_size, device)
    params = [s.params for s in states]
    batch.output_counts = counts
    batch.prompt_mask = prompt_mask
    batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
    batch.host_penalty_below_one = any(p.repetition_penalty < 1.0 for p in params)
    batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
    batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)
