"""SmolLM2-135M-Instruct from its GGUF file as shipped (Q4_1 blocks, Q8_0 table) against transformers
loading the same file dequantised to fp32 (tests/fixtures/gguf/smollm2_reference.json, written by
tools/gguf_fixtures/reference_outputs.py): greedy ids identical on 20 prompts x 64 tokens, one at a
time and all in one batch, and logits within a stated tolerance.

The tolerance. Both sides multiply the same fp32 weights (the blocks dequantised exactly) by fp32
activations and differ only in the order of their fp32 sums (kvserve's block kernels sum per group of
16/32 then scale; torch's GEMM in its own blocking). Each dot product of length K then differs by at
most about K * 2^-24 * sum|x_i w_i| (a few 1e-5 relative at K = 1,536), and 30 layers with residual
adds and RMSNorm carry such differences forward rather than amplifying them much: measured, the
largest logit difference over the fixture's 80 positions is about 1e-4 to 1e-3 on logits of magnitude
about 10-30. LOGIT_ATOL is several times that, and far below the top-two gaps that greedy equality
depends on (those are checked by the ids themselves).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.core.sampling_params import SamplingParams
from tests.real_models import smollm2_gguf

FIXTURE = Path(__file__).parent / "fixtures" / "gguf" / "smollm2_reference.json"
LOGIT_ATOL = 5e-3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    smollm2_gguf()  # skips without the package
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def llm():
    from kvserve.engine.llm import LLM

    return LLM(str(smollm2_gguf()), max_model_len=512, max_num_seqs=32)


def _greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def test_greedy_ids_equal_transformers_batched(llm, reference):
    cases = reference["cases"]
    assert len(cases) >= 20
    got = _greedy(llm, [c["prompt_ids"] for c in cases], reference["new_tokens"])
    mismatches = {
        i: _first_difference(g, c["greedy_ids"]) for i, (g, c) in enumerate(zip(got, cases, strict=True))
    }
    assert {i: p for i, p in mismatches.items() if p is not None} == {}


def test_greedy_ids_equal_transformers_one_at_a_time(llm, reference):
    for i, case in enumerate(reference["cases"]):
        (got,) = _greedy(llm, [case["prompt_ids"]], reference["new_tokens"])
        assert got == case["greedy_ids"], f"prompt {i}: first difference at {_first_difference(got, case['greedy_ids'])}"


def test_logits_within_tolerance(llm, reference):
    worst = 0.0
    for case in reference["cases"][:8]:
        ids = case["prompt_ids"] + case["greedy_ids"]
        logits = llm.engine.score(ids)  # [T, V]
        for position, top in zip(reference["logit_positions"], case["top_logits"], strict=True):
            row = logits[len(case["prompt_ids"]) - 1 + position]
            for token, value in top:
                worst = max(worst, abs(float(row[token]) - value))
    assert worst <= LOGIT_ATOL, worst
