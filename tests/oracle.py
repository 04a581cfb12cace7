"""Comparisons against an oracle that say where and by how much two runs differ."""

from __future__ import annotations

import torch


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.float() - b.float()).abs().max().item()


def assert_logits_close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = ""
) -> None:
    err = (actual.float() - expected.float()).abs()
    if err.max().item() > atol:
        position = int(err.amax(dim=-1).argmax())
        raise AssertionError(
            f"{what}: logits differ by {err.max().item():.3g} > {atol:g}; first worst position {position}"
        )


def top_two_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return (top[0] - top[1]).item()


def first_mismatch(actual: list[int], expected: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(actual, expected, strict=False)):
        if a != b:
            return i
    return None if len(actual) == len(expected) else min(len(actual), len(expected))


def assert_same_tokens(
    actual: list[int], expected: list[int], expected_logits=None, what: str = ""
):
    """Token equality; on a mismatch report the first differing position and the top-two logit gap of the
    reference at that position (a tiny gap means a near-tie, a large one a real bug)."""
    index = first_mismatch(actual, expected)
    if index is None:
        return
    gap = ""
    if expected_logits is not None and index < len(expected_logits):
        gap = f"; reference top-two logit gap there {top_two_gap(expected_logits[index]):.3g}"
    raise AssertionError(
        f"{what}: first differing token at output position {index}: "
        f"{actual[index : index + 3]} vs {expected[index : index + 3]}{gap}"
    )
