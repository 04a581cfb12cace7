"""Gemma 3's hybrid KV cache on the real model (kv/groups.py): a 4,000-token request holds no more
window blocks than the window needs, the planner predicts the engine's KV bytes, and a prefix-cache hit
on a long prompt gives the logits of a cold run. The greedy ids against transformers, batched and solo
with prompts past the window, are tests/gguf/test_gguf_gemma3.py's (the hybrid cache is the default)."""

from __future__ import annotations

import random

import pytest

from kvserve.config import DTYPE_BYTES
from kvserve.core.sampling_params import SamplingParams
from kvserve.lab.plan import arith
from kvserve.lab.plan.model import load_model as load_plan_model
from kvserve.models import resolve_model
from tests.real_models import gemma3_gguf

pytestmark = pytest.mark.slow

WINDOW = 512
BLOCK = 16
CHUNK = 1024


@pytest.fixture(scope="module")
def llm():
    from kvserve.engine.llm import LLM

    return LLM(str(gemma3_gguf()), max_model_len=4200, max_num_seqs=4,
               max_num_batched_tokens=CHUNK, kv_cache_memory_bytes=256 << 20)  # fmt: skip


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200_000) for _ in range(length - 1)]


def test_the_layout_is_gemmas(llm):
    layout = llm.engine.kv_manager.layout
    assert layout.hybrid and layout.group_size == 3
    assert [g.window for g in layout.groups] == [None] + [WINDOW] * 5
    assert llm.engine.kv_manager.groups[0].layers == (5, 11, 17)


def test_a_4000_token_request_holds_only_the_windows_blocks(llm):
    engine = llm.engine
    kv = engine.kv_manager
    plan_model = load_plan_model(str(resolve_model(str(gemma3_gguf()))))  # its model directory
    block_bytes = engine.runner.kv_cache_bytes / engine.runner.num_blocks
    value_bytes = DTYPE_BYTES[engine.config.dtype]
    engine.add_request("long", prompt(4000, 1), SamplingParams(temperature=0.0, max_tokens=24,
                                                                ignore_eos=True))  # fmt: skip
    request = engine.scheduler.requests["long"]
    window_blocks = -(-(WINDOW - 1) // BLOCK) + 1  # a window of keys spans at most this many blocks
    checked = []
    while engine.has_unfinished_requests():
        engine.step()
        if "long" not in engine.scheduler.requests:
            break
        computed = request.num_computed_tokens
        held = kv.num_held("long")
        # during a prompt chunk the window groups hold the window before it and the chunk itself
        assert all(h <= window_blocks + -(-CHUNK // BLOCK) for h in held[1:]), held
        assert held[0] == -(-computed // BLOCK) or held[0] == -(-(computed + 1) // BLOCK)
        if computed > 4000:  # after a decode step: the window's blocks and the new token's at most
            assert all(h <= window_blocks for h in held[1:]), (computed, held)
        if computed in (2048, 4000, 4016):
            # what the next step keeps (it returns what the window left, as allocate_slots does
            # before every step) against the planner's arithmetic for this context
            assert kv.allocate_slots(request, 0)
            engine_bytes = sum(kv.num_held("long")) * block_bytes
            planned = arith.kv_bytes_per_sequence(plan_model, value_bytes, computed, BLOCK)
            assert abs(engine_bytes - planned) <= 0.01 * planned, (computed, engine_bytes, planned)
            full = arith.kv_bytes_per_token(plan_model, value_bytes) * computed
            assert engine_bytes < full / 2.5  # 3 of 18 layers keep everything
            checked.append(computed)
    assert checked == [2048, 4000, 4016]
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_prefix_hit_on_a_long_prompt_gives_the_cold_logits(llm):
    ids = prompt(1500, 2)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    assert llm.reset_prefix_cache()
    (cold,) = llm.generate([ids], params)
    (warm,) = llm.generate([ids], params)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens >= 1500 - BLOCK  # every group served the prefix
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for a, b in zip(cold.outputs[0].logprobs, warm.outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-4, (a, b)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        for (_, x), (_, y) in zip(a.top, b.top, strict=True):
            assert abs(x - y) <= 1e-4, (a, b)
    llm.engine.check_invariants()


def test_preemption_and_ngram_speculation_keep_the_greedy_ids(llm):
    """A cache too small for the batch (requests preempted and recomputed) with n-gram proposals
    verified through the window layers: the greedy ids of a roomy cache without speculation."""
    from kvserve.engine.llm import LLM

    rng = random.Random(3)
    phrase = [rng.randrange(1000, 200_000) for _ in range(40)]
    prompts = [[2] + (phrase * 20)[i * 7 : i * 7 + 700] for i in range(4)]  # repetitive: proposals hit
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    tight = LLM(str(gemma3_gguf()), max_model_len=1024, max_num_seqs=4, num_blocks=460,
                max_num_batched_tokens=256, speculative_method="ngram",
                num_speculative_tokens=4)  # fmt: skip
    got = [list(o.outputs[0].token_ids) for o in tight.generate(prompts, params)]
    stats = tight.engine.scheduler.stats
    assert got == expected
    assert stats.num_preemptions > 0  # the cache was too small for the four at once
    assert tight.engine.runner.spec_stats.num_accepted > 0
    tight.engine.check_invariants()
    assert tight.engine.num_free_blocks() == tight.engine.num_blocks
