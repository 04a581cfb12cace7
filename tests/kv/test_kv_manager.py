"""Block pool and KV manager: exact block ids, eviction order, and invariants under random operations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager

BS = 4


def make_request(request_id: str, tokens, salt: str | None = None) -> Request:
    return Request(
        request_id,
        tuple(tokens),
        SamplingParams(max_tokens=8),
        max_tokens=8,
        cache_salt=salt,
    )


def admit(kv: KVCacheManager, request: Request) -> int:
    hits, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_cached


def test_allocation_is_in_queue_order_and_freeing_puts_tails_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(10))  # 3 blocks
    admit(kv, a)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(a)
    # Freed tail first: block 2 (partial), then 1, then 0 join the back of the queue.
    assert list(kv.pool._free) == [3, 4, 5, 6, 7, 2, 1, 0]
    kv.check_invariants()


def test_prefix_hit_reuses_exact_blocks_and_keeps_last_token_uncached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(8))  # exactly 2 full blocks
    admit(kv, a)
    kv.free(a)
    b = make_request("b", range(8))
    hits, num_cached = kv.get_computed_blocks(b)
    # The last token must be computed to sample, so only the first block may hit.
    assert (hits, num_cached) == (([0],), 4)
    c = make_request("c", list(range(8)) + [99])
    assert kv.get_computed_blocks(c) == (([0, 1],), 8)
    kv.check_invariants()


def test_lru_eviction_of_cached_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", range(4 * 2 + 1))  # blocks 0, 1 full and cached; 2 partial
    admit(kv, a)
    kv.free(a)
    b = make_request(
        "b", [50 + i for i in range(4 * 3 + 1)]
    )  # needs all 4 blocks: evicts everything
    assert admit(kv, b) == 0
    assert sorted(kv.block_ids("b")) == [0, 1, 2, 3]
    assert kv.pool.num_evictions == 2
    kv.free(b)
    assert kv.get_computed_blocks(make_request("a2", range(9)))[1] == 0
    kv.check_invariants()


def test_salt_changes_every_hash():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", range(9), salt="x"))
    assert kv.get_computed_blocks(make_request("b", range(9), salt="y"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", range(9)))[1] == 0
    assert kv.get_computed_blocks(make_request("d", range(9), salt="x"))[1] == 8


def test_changed_first_block_changes_later_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", range(9)))
    other = [100] + list(range(1, 9))
    assert kv.get_computed_blocks(make_request("b", other))[1] == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "grow", "free", "preempt"]),
            st.integers(0, 5),  # request slot
            st.integers(1, 23),  # length
            st.integers(0, 3),  # prefix family (shared prefixes make cache hits)
        ),
        max_size=60,
    ),
    num_blocks=st.integers(4, 24),
    caching=st.booleans(),
)
def test_invariants_hold_under_random_operations(ops, num_blocks, caching):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    live: dict[int, Request] = {}
    serial = 0
    for op, slot, length, family in ops:
        if op == "add" and slot not in live:
            serial += 1
            request = make_request(f"r{serial}", [family * 1000 + i for i in range(length)])
            hits, num_cached = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - num_cached, hits):
                request.num_computed_tokens = request.num_tokens
                kv.cache_full_blocks(request)
                live[slot] = request
        elif op == "grow" and slot in live:
            request = live[slot]
            request.output_token_ids.extend(range(length % 5 + 1))
            new = request.num_tokens - request.num_computed_tokens
            if kv.allocate_slots(request, new):
                request.num_computed_tokens = request.num_tokens
                kv.cache_full_blocks(request)
        elif op in ("free", "preempt") and slot in live:
            kv.free(live.pop(slot))
        kv.check_invariants()
        held = sum(len(kv.block_ids(r.request_id)) for r in live.values())
        assert kv.num_free_blocks <= num_blocks
        assert held >= num_blocks - kv.num_free_blocks  # shared blocks are counted once by the pool
    for request in live.values():
        kv.free(request)
    kv.check_invariants()
    assert kv.num_free_blocks == num_blocks


def test_pool_rejects_double_free():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    try:
        pool.free(ids)
    except RuntimeError as exc:
        assert "ref_cnt 0" in str(exc)
    else:
        raise AssertionError("double free was accepted")


def test_measured_kv_bytes_per_token(checkpoints):
    from kvserve import LLM

    for arch in ("llama", "qwen3"):
        model_dir, hf_model = checkpoints[arch]
        llm = LLM(str(model_dir), num_blocks=8)
        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # fp32
        assert llm.engine.runner.kv_bytes_per_token == expected
        assert llm.engine.config.kv_bytes_per_token == expected
