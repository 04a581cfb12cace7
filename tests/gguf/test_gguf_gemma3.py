"""Gemma 3 270M from its GGUF file as shipped (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 blocks) against
transformers loading the same file dequantised to fp32 (tests/fixtures/gguf/gemma3_reference.json,
written by tools/gguf_fixtures/reference_outputs.py): greedy ids identical on 20 prompts x 64
tokens, ten of them 600 to 2,000 tokens long so that the sliding window (512) is exercised, all in
one batch and some one at a time, and logits within a stated tolerance.

The tolerance is derived as tests/gguf/test_gguf_smollm2.py derives its own: both sides multiply the same
exactly dequantised weights by fp32 activations and differ in the order of fp32 sums only. Gemma's
18 layers each add a post-attention and a post-MLP norm, which rescale rather than amplify such
differences; LOGIT_ATOL is the SmolLM2 bound, and the measured worst case is printed in the failure.
"""

from __future__ import annotations

import json

import pytest

from tests import FIXTURES
from tests.gguf_reference import batched_mismatches, solo_mismatches, worst_logit_difference
from tests.real_models import gemma3_gguf

FIXTURE = FIXTURES / "gguf" / "gemma3_reference.json"
LOGIT_ATOL = 5e-3
WINDOW = 512

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def llm():
    from kvserve.engine.llm import LLM

    return LLM(str(gemma3_gguf()), max_model_len=2200, max_num_seqs=20,
               kv_cache_memory_bytes=1 << 30, gguf_activations="fp32")  # fmt: skip


def test_the_fixture_exercises_the_window(reference):
    lengths = [len(c["prompt_ids"]) for c in reference["cases"]]
    assert len(lengths) >= 20 and sum(n > WINDOW for n in lengths) >= 8, lengths
    assert max(lengths) >= 1900


def test_greedy_ids_equal_transformers_batched(llm, reference):
    assert batched_mismatches(llm, reference) == {}


def test_greedy_ids_equal_transformers_one_at_a_time(llm, reference):
    # two short prompts and the three longest (the window's blocks), each decoded alone
    by_length = sorted(
        range(len(reference["cases"])), key=lambda i: len(reference["cases"][i]["prompt_ids"])
    )
    assert solo_mismatches(llm, reference, by_length[:2] + by_length[-3:]) == {}


def test_logits_within_tolerance(llm, reference):
    worst = worst_logit_difference(llm, reference, [0, 1, 2, 10, 11, 19])
    assert worst <= LOGIT_ATOL, worst
