"""The paged, cached, chunked and prefix-cached paths against a full recompute (logits, not only tokens)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.oracle import assert_logits_close, assert_same_tokens

TOL = 1e-4
PROMPT = [
    (i * 37 + 11) % 250 + 3 for i in range(53)
]  # 53 tokens: 3 full blocks of 16 and a partial


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_blocks=128, block_size=16)


@contextlib.contextmanager
def shifted_rope(llm: LLM, shift: int, from_position: int):
    """A deliberate bug: tokens at or after `from_position` (the decode path) are rotated `shift` positions
    too far, while the keys cached before them are right. (A uniform shift of every position would be
    invisible: RoPE attention depends only on position differences.) The model's forward uses its
    positions for RoPE only (both the per-op path and the fused step, which looks the rows up in C),
    so the shift goes in there."""
    model = llm.engine.runner.model
    original = model.forward

    def shifted(input_ids, positions, *args):
        return original(input_ids, positions + shift * (positions >= from_position), *args)

    model.forward = shifted
    try:
        yield
    finally:
        del model.forward  # the class's method again


def test_cached_decode_path_equals_full_recompute(llm):
    full = llm.engine.score(PROMPT)  # one forward over the whole prompt
    one_at_a_time = llm.engine.score(PROMPT, chunk_size=1)  # every token attends to cached keys
    assert_logits_close(one_at_a_time, full, TOL, "token-by-token cached path")
    llm.engine.check_invariants()


def test_shifted_rope_position_is_caught(llm):
    """A test of the test: a RoPE off by one position in the cached path must fail the logit check."""
    full = llm.engine.score(PROMPT)
    with shifted_rope(llm, shift=1, from_position=40):
        shifted = llm.engine.score(PROMPT, chunk_size=1)
    # The positions before the bug are untouched, so the check must point past them.
    assert_logits_close(shifted[:40], full[:40], TOL, "before the shifted positions")
    with pytest.raises(AssertionError, match="logits differ"):
        assert_logits_close(shifted, full, TOL, "shifted rope")


def test_chunked_prefill_budget_7_equals_unchunked(llama_dir):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    whole = LLM(str(llama_dir), num_blocks=64, max_num_batched_tokens=4096)
    chunked = LLM(str(llama_dir), num_blocks=64, max_num_batched_tokens=7)
    expected = whole.generate([PROMPT], params)[0].outputs[0].token_ids
    actual = chunked.generate([PROMPT], params)[0].outputs[0].token_ids
    reference_logits = whole.engine.score(PROMPT + expected)[len(PROMPT) - 1 :]
    assert_same_tokens(actual, expected, reference_logits, "chunked prefill")
    # And the logits of a 7-token chunked pass over the prompt equal the one-shot pass.
    assert_logits_close(chunked.engine.score(PROMPT, chunk_size=7), whole.engine.score(PROMPT), TOL)
    chunked.engine.check_invariants()


def test_prefix_cache_hit_equals_cold_run(llama_dir):
    llm = LLM(str(llama_dir), num_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    cold = llm.generate([PROMPT], params)[0]
    assert cold.num_cached_tokens == 0
    warm = llm.generate([PROMPT], params)[0]
    # 53 prompt tokens: three full blocks (48 tokens) come from the cache.
    assert warm.num_cached_tokens == 48
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    cold_lp = torch.tensor([lp.logprob for lp in cold.outputs[0].logprobs])
    warm_lp = torch.tensor([lp.logprob for lp in warm.outputs[0].logprobs])
    assert_logits_close(warm_lp, cold_lp, TOL, "logprobs of a prefix-cache hit")
    # A longer prompt sharing the prefix hits the same blocks.
    longer = llm.generate([PROMPT + [5, 6, 7]], params)[0]
    assert longer.num_cached_tokens == 48
    stats = llm.engine.kv_manager.stats
    assert stats.num_hits == 96 and stats.num_queries == 53 + 53 + 56
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_cache_salt_isolates_tenants(llama_dir):
    llm = LLM(str(llama_dir), num_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = llm.generate([PROMPT], params, cache_salt="tenant-a")[0]
    b = llm.generate([PROMPT], params, cache_salt="tenant-b")[0]
    plain = llm.generate([PROMPT], params)[0]
    a_again = llm.generate([PROMPT], params, cache_salt="tenant-a")[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, plain.num_cached_tokens) == (0, 0, 0)
    assert a_again.num_cached_tokens == 48
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == plain.outputs[0].token_ids


def test_cache_salt_blocks_never_shared_while_running(llama_dir):
    """Two salted requests running side by side hold disjoint blocks."""
    llm = LLM(str(llama_dir), num_blocks=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", PROMPT, params, cache_salt="a")
    engine.step()
    engine.add_request("b", PROMPT, params, cache_salt="b")
    engine.step()
    blocks_a = set(engine.kv_manager.block_ids("a"))
    blocks_b = set(engine.kv_manager.block_ids("b"))
    assert blocks_a and blocks_b and not blocks_a & blocks_b
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
