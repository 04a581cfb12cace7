"""The hybrid KV manager (kv/groups.py): a window group returns the blocks no later query sees, prefix hits
count only as far as every group can serve them, and the bookkeeping stays exact under random use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.groups import NULL_BLOCK, KVGroup, KVLayout, plan_layout
from kvserve.kv.manager import KVCacheManager

BS = 4
WINDOW = 6  # a query sees itself and the 5 keys before it


def gemma_like(num_layers: int = 6, window: int = WINDOW) -> KVLayout:
    """Five window layers per global one, as Gemma 3 (layer 5 global)."""
    return plan_layout(tuple(None if i % 6 == 5 else window for i in range(num_layers)))


def request(request_id: str, tokens, salt: str | None = None) -> Request:
    return Request(request_id, tuple(tokens), SamplingParams(max_tokens=64), max_tokens=64,
                   cache_salt=salt)  # fmt: skip


def run_prompt(kv: KVCacheManager, req: Request, chunk: int) -> int:
    """Admit and compute the prompt in chunks of `chunk` tokens, as the scheduler does."""
    hits, num_cached = kv.get_computed_blocks(req)
    first = min(chunk, req.num_tokens - num_cached)
    assert kv.allocate_slots(req, first, hits)
    req.num_computed_tokens = num_cached + first
    kv.cache_full_blocks(req)
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        kv.cache_full_blocks(req)
    return num_cached


def test_layouts_group_layers_of_one_kind_in_equal_groups():
    gemma_270m = tuple(None if i % 6 == 5 else 512 for i in range(18))
    layout = plan_layout(gemma_270m, max_model_len=32768)
    assert layout.group_size == 3 and len(layout.groups) == 6
    assert layout.groups[0] == KVGroup(None, (5, 11, 17))
    assert [g.window for g in layout.groups[1:]] == [512] * 5
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(18))
    assert layout.layer_group[5] == 0 and layout.layer_slot[11] == 1
    # no saving to be had: one group, as before
    assert not plan_layout((None,) * 4).hybrid
    assert not plan_layout((512,) * 4).hybrid  # every layer windowed
    assert not plan_layout((None, 512, 1024)).hybrid  # two windows
    assert not plan_layout(gemma_270m, max_model_len=512).hybrid


def test_window_blocks_return_to_the_pool_as_decoding_moves_on():
    layout = gemma_like()  # groups: full (1 layer), window (5 groups of 1)
    kv = KVCacheManager(num_blocks=200, block_size=BS, layout=layout)
    req = request("a", range(30))
    run_prompt(kv, req, chunk=8)
    tables = kv.group_block_ids("a")
    assert len(tables[0]) == 8 and NULL_BLOCK not in tables[0]
    # the next query is at position 30 and sees keys 25..30: blocks 6 and 7 only, once the next step's
    # allocation has returned the rest
    assert kv.allocate_slots(req, 1)
    for table in kv.group_block_ids("a")[1:]:
        assert table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in table[6:]
    assert kv.num_held("a") == [8] + [2] * 5
    for _ in range(40):  # decode 40 tokens
        req.output_token_ids.append(1)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)
        held = kv.num_held("a")
        assert held[0] == -(-(req.num_computed_tokens) // BS)
        # the window of the last query (5 keys back) spans at most 3 blocks of 4
        assert all(h <= 3 for h in held[1:]), held
        kv.check_invariants()
    kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_prefix_hit_needs_every_group_to_hold_the_window_before_it():
    layout = gemma_like()
    kv = KVCacheManager(num_blocks=200, block_size=BS, layout=layout)
    a = request("a", range(40))
    run_prompt(kv, a, chunk=8)
    kv.free(a)
    kv.check_invariants()
    # every block of every group was cached before its window left it: a full hit
    b = request("b", list(range(40)) + [7])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 40
    first = -(-(40 - WINDOW + 1) // BS) - 1  # block of position 35: 8
    assert first == (40 - WINDOW + 1) // BS
    for table in hits[1:]:
        assert table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[first:]
    # evict the window group's blocks of the last window: the hit falls back to a point whose window
    # every group still holds
    for index in range(1, len(layout.groups)):
        key = kv._key(kv._block_hashes(b)[9], index)
        block = kv.pool.lookup(key)
        kv.pool._cached.pop(key)
        kv.pool.blocks[block].block_hash = None
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 36  # block 9 (tokens 36..39) is the first that some window group lacks
    kv.check_invariants()


def test_siblings_share_only_what_every_group_still_holds():
    layout = gemma_like()
    kv = KVCacheManager(num_blocks=200, block_size=BS, layout=layout, enable_prefix_caching=False)
    src = request("src", range(40))
    run_prompt(kv, src, chunk=40)
    shared, num = kv.shared_prefix("src", 39 // BS)
    # 9 blocks of the prompt: the window of position 36 starts at 31 (block 7), which src still holds
    assert num == 36
    assert all(t[:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in t[7:] for t in shared[1:])
    sib = request("sib", range(40))
    assert kv.allocate_slots(sib, 4, shared)
    sib.num_computed_tokens = 40
    kv.check_invariants()
    # once src has moved on, its window no longer covers any prefix end: nothing to share (with
    # prefix caching the returned blocks stay cached and a sibling hits them there instead)
    assert kv.allocate_slots(src, 1)
    assert kv.shared_prefix("src", 39 // BS)[1] == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=40
    ),
    caching=st.booleans(),
)
def test_random_use_keeps_the_books_exact(ops, caching):
    """Admit, step and free requests at random over shared prefixes: references match holders, window
    groups never hold a block their next query cannot see, and everything returns at the end."""
    layout = gemma_like(12, window=7)
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=caching, layout=layout)
    live: dict[str, Request] = {}
    for n, (kind, length, prefix) in enumerate(ops):
        if kind <= 2:
            tokens = [prefix] * 8 + list(range(100 * n, 100 * n + length))
            req = request(f"r{n}", tokens)
            hits, cached = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - cached, hits):
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
                live[req.request_id] = req
        elif kind <= 4 and live:
            req = live[sorted(live)[length % len(live)]]
            req.output_token_ids.append(length)
            if kv.allocate_slots(req, 1):
                req.num_computed_tokens += 1
                kv.cache_full_blocks(req)
        elif live:
            kv.free(live.pop(sorted(live)[length % len(live)]))
        kv.check_invariants()
        for req in live.values():
            for group, table in zip(layout.groups, kv.group_block_ids(req.request_id), strict=True):
                first = group.first_needed_block(req.num_computed_tokens - 1, BS)
                assert NULL_BLOCK not in table[first:] or group.window is None
    for req in list(live.values()):
        kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_the_most_a_request_holds_is_what_the_fit_check_assumes():
    layout = gemma_like()
    kv = KVCacheManager(num_blocks=500, block_size=BS, layout=layout)
    req = request("a", range(100))
    peak = 0
    hits, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 16, hits)
    req.num_computed_tokens = 16
    while req.num_computed_tokens < 100:
        n = min(16, 100 - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)
        peak = max(peak, sum(kv.num_held("a")))
        req.num_computed_tokens += n
    assert peak <= kv.num_blocks_for(100, 16)
    full = -(-100 // BS)
    assert kv.num_blocks_for(100, 16) < 6 * full  # far less than six full tables


def test_the_simulator_keeps_a_hybrid_models_blocks_as_the_engine_does():
    """Eight 3,000-token requests on a Gemma-3-270M-shaped model: with every layer global the cache
    holds two at a time and the others preempt or wait; with the groups all eight run at once."""
    from kvserve.config import SchedulerConfig
    from kvserve.lab.plan.model import from_hf_config
    from kvserve.lab.sim.loop import simulate_continuous
    from kvserve.lab.sim.workload import SimRequest
    from tests.gguf.test_gemma3 import GEMMA3_270M

    spec = from_hf_config(GEMMA3_270M)
    layout = plan_layout(spec.layer_windows, 4096)
    assert layout.hybrid and layout.group_size == 3
    requests = tuple(SimRequest(i, 0.0, 3000, 16) for i in range(8))
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096)

    class Unit:
        def step_s(self, _out):
            return 1.0

        def describe(self):
            return {}

    cache_bytes = 2 * 3016 * 18 * 2 * 256 * 2  # two full-attention requests' KV (bf16)
    runs = {}
    for name, lay in (("full", None), ("hybrid", layout)):
        slots = 18 if lay is None else lay.group_size
        num_blocks = cache_bytes // (16 * slots * 2 * 256 * 2)
        runs[name] = simulate_continuous(requests, Unit(), sched, num_blocks, 16, False,
                                         layout=lay)  # fmt: skip
    assert runs["hybrid"].num_preemptions == 0
    assert runs["hybrid"].end_s < runs["full"].end_s
    assert all(t.error is None for t in runs["hybrid"].timelines)
