"""Comparing one prompt's greedy generation in a batch shape against the same prompt alone.

A generation is a `Trace`: per output position, the chosen token, its log probability and the
top-k alternatives (token -> log probability). Tokens are keyed by id offline and by their text
through an endpoint. Log probabilities are the logits less the position's log-sum-exp, so a
difference in them is a logit difference with the per-position constant removed; top-two gaps are
exactly logit gaps (docs/determinism.md).

Positions are compared up to and including the first differing token: until then both runs saw
the same context, so their distributions must agree; after it the contexts differ.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Position:
    """One output position: the chosen token, its log probability, the top-k alternatives."""

    token: Hashable
    logprob: float
    top: dict[Hashable, float]

    @property
    def top_two_gap(self) -> float | None:
        """Log-probability (= logit) gap between the two most likely tokens, if k >= 2."""
        values = sorted(self.top.values(), reverse=True)
        return values[0] - values[1] if len(values) >= 2 else None


@dataclass(frozen=True)
class Trace:
    """One prompt's generation in one shape; `num_cached_tokens` says if the prefix cache hit and
    `num_spec_accepted` if speculative verification took part."""

    positions: tuple[Position, ...]
    num_cached_tokens: int = 0
    num_spec_accepted: int = 0

    @property
    def tokens(self) -> list[Hashable]:
        return [p.token for p in self.positions]


@dataclass(frozen=True)
class Comparison:
    """A variant's trace against the reference (the prompt alone)."""

    num_positions: int
    first_differing_position: int | None  # None: every token equal
    max_abs_logprob_diff: float  # over the top-k tokens both runs list, compared positions
    max_diff_position: int | None
    min_gap_argmax_held: float | None  # smallest reference top-two gap where the tokens agreed
    gap_at_divergence: float | None  # the reference's top-two gap at the first differing token
    num_cached_tokens: int = 0
    num_spec_accepted: int = 0

    @property
    def tokens_equal(self) -> bool:
        return self.first_differing_position is None

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens_equal": self.tokens_equal,
            "first_differing_position": self.first_differing_position,
            "num_positions": self.num_positions,
            "max_abs_logprob_diff": self.max_abs_logprob_diff,
            "max_diff_position": self.max_diff_position,
            "min_gap_argmax_held": self.min_gap_argmax_held,
            "gap_at_divergence": self.gap_at_divergence,
            "num_cached_tokens": self.num_cached_tokens,
            "num_spec_accepted": self.num_spec_accepted,
        }


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: Trace, variant: Trace) -> Comparison:
    first = first_difference(variant.tokens, reference.tokens)
    last = len(reference.positions) - 1 if first is None else first
    last = min(last, len(variant.positions) - 1)
    max_diff, max_at = 0.0, None
    min_gap = None
    for i in range(last + 1):
        ref, var = reference.positions[i], variant.positions[i]
        common = set(ref.top) & set(var.top)
        diffs = [abs(ref.top[t] - var.top[t]) for t in common]
        if ref.token == var.token:
            diffs.append(abs(ref.logprob - var.logprob))
            gap = ref.top_two_gap
            if gap is not None and (min_gap is None or gap < min_gap):
                min_gap = gap
        worst = max(diffs, default=0.0)
        if worst > max_diff or (math.isnan(worst) and not math.isnan(max_diff)):
            max_diff, max_at = worst, i
    gap_at = None
    if first is not None and first < len(reference.positions):
        gap_at = reference.positions[first].top_two_gap
    return Comparison(
        num_positions=len(reference.positions),
        first_differing_position=first,
        max_abs_logprob_diff=max_diff,
        max_diff_position=max_at,
        min_gap_argmax_held=min_gap,
        gap_at_divergence=gap_at,
        num_cached_tokens=variant.num_cached_tokens,
        num_spec_accepted=variant.num_spec_accepted,
    )


@dataclass(frozen=True)
class ShapeResult:
    """Every prompt of one batch shape compared with its solo run."""

    name: str
    description: str
    comparisons: tuple[tuple[int, Comparison], ...]  # (prompt index, comparison)
    facts: dict[str, Any]  # what the shape exercised (cache hits, verify steps, chunking)

    @property
    def num_diverged(self) -> int:
        return sum(not c.tokens_equal for _, c in self.comparisons)

    @property
    def max_abs_logprob_diff(self) -> float:
        return max((c.max_abs_logprob_diff for _, c in self.comparisons), default=0.0)

    @property
    def earliest_divergence(self) -> int | None:
        firsts = [c.first_differing_position for _, c in self.comparisons if not c.tokens_equal]
        return min(firsts, default=None)

    @property
    def min_gap_argmax_held(self) -> float | None:
        gaps = [c.min_gap_argmax_held for _, c in self.comparisons if c.min_gap_argmax_held]
        return min(gaps, default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "num_prompts": len(self.comparisons),
            "num_diverged": self.num_diverged,
            "earliest_divergence": self.earliest_divergence,
            "max_abs_logprob_diff": self.max_abs_logprob_diff,
            "min_gap_argmax_held": self.min_gap_argmax_held,
            "facts": self.facts,
            "prompts": [{"prompt": i} | c.to_json() for i, c in self.comparisons],
        }


def compare_shape(
    name: str,
    description: str,
    references: list[Trace],
    variants: dict[int, Trace],
    facts: dict[str, Any] | None = None,
) -> ShapeResult:
    """Compare `variants` (prompt index -> its trace in this shape) with their references."""
    comparisons = tuple((i, compare(references[i], trace)) for i, trace in sorted(variants.items()))
    return ShapeResult(name, description, comparisons, facts or {})
