"""Continuous batching: preemption by recompute and batch invariance of greedy tokens."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.oracle import assert_same_tokens

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def prompts(count: int) -> list[list[int]]:
    # Different lengths (5 .. 68 tokens), different contents.
    return [[(i * 31 + j * 7 + 3) % 250 + 3 for j in range(5 + 9 * i)] for i in range(count)]


@pytest.fixture(scope="module")
def solo(llama_dir):
    """Each prompt run alone: tokens and the reference logits along the generated sequence."""
    llm = LLM(str(llama_dir), num_blocks=256)
    results = []
    for prompt in prompts(8):
        tokens = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        logits = llm.engine.score(prompt + tokens)[len(prompt) - 1 :]
        results.append((tokens, logits))
    return results


def test_batch_of_8_gives_solo_tokens(llama_dir, solo):
    llm = LLM(str(llama_dir), num_blocks=256, max_num_batched_tokens=64)
    outputs = llm.generate(prompts(8), GREEDY)
    for i, (output, (tokens, logits)) in enumerate(zip(outputs, solo, strict=True)):
        assert_same_tokens(
            output.outputs[0].token_ids, tokens, logits, what=f"request {i} in a batch"
        )
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_preemption_keeps_tokens_and_frees_the_pool(llama_dir, solo):
    # 8 requests need up to ceil((68 + 40) / 16) = 7 blocks each; 14 blocks hold two at most.
    llm = LLM(str(llama_dir), num_blocks=14, block_size=16, enable_prefix_caching=False)
    outputs = llm.generate(prompts(8), GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0, "the cache was meant to force preemption"
    assert (
        sum(o.metrics.num_preemptions for o in outputs)
        == llm.engine.scheduler.stats.num_preemptions
    )
    for i, (output, (tokens, logits)) in enumerate(zip(outputs, solo, strict=True)):
        assert output.outputs[0].finish_reason == "length"
        assert_same_tokens(
            output.outputs[0].token_ids, tokens, logits, what=f"request {i} preempted"
        )
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == 14


def test_preemption_with_prefix_caching_and_chunking(llama_dir, solo):
    llm = LLM(str(llama_dir), num_blocks=14, max_num_batched_tokens=16)
    outputs = llm.generate(prompts(8), GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for i, (output, (tokens, logits)) in enumerate(zip(outputs, solo, strict=True)):
        assert_same_tokens(output.outputs[0].token_ids, tokens, logits, what=f"request {i}")
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == 14


def test_reserve_admission_never_preempts(llama_dir, solo):
    llm = LLM(str(llama_dir), num_blocks=14, admission="reserve")
    outputs = llm.generate(prompts(8), GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions == 0
    for output, (tokens, logits) in zip(outputs, solo, strict=True):
        assert_same_tokens(output.outputs[0].token_ids, tokens, logits, what="reserve")
    assert llm.engine.num_free_blocks() == 14


def test_max_num_seqs_bounds_the_running_set(llama_dir):
    llm = LLM(str(llama_dir), num_blocks=256, max_num_seqs=3)
    engine = llm.engine
    for i, prompt in enumerate(prompts(6)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.scheduler.num_running)
    assert peak == 3


def test_timestamps_are_ordered(llama_dir):
    llm = LLM(str(llama_dir), num_blocks=64)
    output = llm.generate([prompts(1)[0]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    m = output.outputs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times)
    assert m.token_times[0] == m.first_token_time and m.token_times[-1] == m.finished_time
