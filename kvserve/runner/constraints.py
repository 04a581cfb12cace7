"""Applying per-request grammar masks to rows of logits, including rows that lie past unverified proposals.

A row (matcher, offset j, lookahead tokens) asks for the grammar state after the first j lookahead tokens
(speculative proposals) are accepted. The matcher is advanced through them, the row's bitmask is filled, and
the matcher is rolled back afterwards, so its state always reflects committed tokens only. A proposal the
grammar refuses stops the advance: later rows reuse the last valid state, and verification rejects the
refused proposal because its row forbids it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.structured.grammar import GrammarCache


@dataclass(frozen=True)
class MaskRow:
    row: int  # index into the logits
    matcher: object  # xgrammar.GrammarMatcher
    offset: int = 0  # proposals to accept before this row
    lookahead: tuple[int, ...] = ()
    json: bool = False  # a JSON grammar: also ban tokens with raw control characters


def apply_grammar_masks(
    grammars: GrammarCache, logits: torch.Tensor, rows: Sequence[MaskRow]
) -> float:
    """Mask `logits` [R, V] in place; returns the seconds spent filling and applying the masks."""
    if not rows:
        return 0.0
    start = time.perf_counter()
    bitmask = grammars.allocate_bitmask(logits.shape[0])
    masked: list[int] = []
    json_rows: list[int] = []
    by_matcher: dict[int, list[MaskRow]] = {}
    for row in rows:
        by_matcher.setdefault(id(row.matcher), []).append(row)
    for group in by_matcher.values():
        matcher = group[0].matcher
        accepted = 0
        for row in sorted(group, key=lambda r: r.offset):
            while accepted < row.offset and accepted < len(row.lookahead):
                if matcher.is_terminated() or not matcher.accept_token(row.lookahead[accepted]):
                    break
                accepted += 1
            if matcher.is_terminated():
                continue  # the request ends with its stop token; nothing after it is used
            matcher.fill_next_token_bitmask(bitmask, row.row)
            masked.append(row.row)
            if row.json:
                json_rows.append(row.row)
        if accepted:
            matcher.rollback(accepted)
    if masked:
        grammars.apply_bitmask(logits, bitmask, masked, json_rows)
    return time.perf_counter() - start


def commit_tokens(matcher, token_ids: Sequence[int]) -> int | None:
    """Advance a request's matcher by its committed tokens. Returns how many of them to keep when the
    grammar terminated (through its stop token), else None. A verification step emits the accepted
    proposals and one more token, and the rows after the grammar's end are not masked (above): with
    `ignore_eos` or `min_tokens` the stop token does not end the request, so the tokens after it
    must be cut here (else a choice of "yes" could come back "yes\n" with a draft model)."""
    for used, token_id in enumerate(token_ids):
        if matcher.is_terminated():
            return used
        if not matcher.accept_token(token_id):
            break
    return len(token_ids) if matcher.is_terminated() else None
