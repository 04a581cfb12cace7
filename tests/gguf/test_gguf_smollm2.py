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

import pytest

from tests import FIXTURES
from tests.gguf_reference import batched_mismatches, solo_mismatches, worst_logit_difference
from tests.real_models import smollm2_gguf

FIXTURE = FIXTURES / "gguf" / "smollm2_reference.json"
LOGIT_ATOL = 5e-3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    smollm2_gguf()  # skips without the package
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def llm():
    from kvserve.engine.llm import LLM

    return LLM(str(smollm2_gguf()), max_model_len=512, max_num_seqs=32, gguf_activations="fp32")


def test_greedy_ids_equal_transformers_batched(llm, reference):
    assert len(reference["cases"]) >= 20
    assert batched_mismatches(llm, reference) == {}


def test_greedy_ids_equal_transformers_one_at_a_time(llm, reference):
    assert solo_mismatches(llm, reference, list(range(len(reference["cases"])))) == {}


def test_logits_within_tolerance(llm, reference):
    worst = worst_logit_difference(llm, reference, list(range(8)))
    assert worst <= LOGIT_ATOL, worst
