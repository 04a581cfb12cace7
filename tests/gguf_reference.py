"""Comparing kvserve on a real GGUF file with a transformers fixture written by
tools/gguf_fixtures/reference_outputs.py (tests/gguf/test_gguf_smollm2.py, tests/gguf/test_gguf_gemma3.py)."""

from __future__ import annotations

from kvserve.core.sampling_params import SamplingParams


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def batched_mismatches(llm, reference: dict) -> dict[int, int]:
    """prompt index -> first differing position, for every prompt decoded in one batch."""
    cases = reference["cases"]
    got = greedy(llm, [c["prompt_ids"] for c in cases], reference["new_tokens"])
    found = {
        i: first_difference(g, c["greedy_ids"])
        for i, (g, c) in enumerate(zip(got, cases, strict=True))
    }
    return {i: p for i, p in found.items() if p is not None}


def solo_mismatches(llm, reference: dict, indices: list[int]) -> dict[int, int]:
    """The same, each prompt of `indices` decoded alone."""
    found = {}
    for i in indices:
        case = reference["cases"][i]
        (got,) = greedy(llm, [case["prompt_ids"]], reference["new_tokens"])
        if (where := first_difference(got, case["greedy_ids"])) is not None:
            found[i] = where
    return found


def worst_logit_difference(llm, reference: dict, indices: list[int]) -> float:
    """The largest |kvserve - transformers| over the fixture's kept top logits of prompts `indices`."""
    worst = 0.0
    for i in indices:
        case = reference["cases"][i]
        logits = llm.engine.score(case["prompt_ids"] + case["greedy_ids"])  # [T, V]
        for position, top in zip(reference["logit_positions"], case["top_logits"], strict=True):
            row = logits[len(case["prompt_ids"]) - 1 + position]
            for token, value in top:
                worst = max(worst, abs(float(row[token]) - value))
    return worst
