"""Block tables cross the scheduler-runner boundary as changes (kvserve/core/block_tables.py): the
scheduler sends a request's tables whole only when the runner holds none for it (admitted, resumed
after preemption), else only the blocks appended and a window group's new leading nulls.

Each test drives the scheduler with a stand-in runner that keeps what a runner keeps (`BlockTables`,
dropped on finish and preemption) and checks after every step that (a) the rebuilt tables equal the
KV manager's, and (b) the block ids a step sends for a request are the blocks that changed: none of
the blocks it already held, so a step's size does not grow with the sequence."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.block_tables import (
    CHANGE,
    DROP,
    NULL_BLOCK,
    BlockTables,
    TableChangeError,
    TableSender,
)
from kvserve.core.outputs import RunnerOutput, SampledTokens, SchedulerOutput
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.groups import KVGroup, KVLayout
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.scheduler import Scheduler

BS = 4
WINDOW = 10  # a query of the window group sees itself and the 9 keys before it


def window_layout() -> KVLayout:
    """One full-attention layer and two window layers, one layer per group (as Gemma 3, smaller)."""
    return KVLayout((KVGroup(None, (0,)), KVGroup(WINDOW, (1,)), KVGroup(WINDOW, (2,))), 1)


class TableKeeper:
    """What a runner keeps of the block tables, and the checks after each step."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.tables = BlockTables(len(self.kv.groups))
        self.held: dict[str, int] = {}  # blocks per table the runner held before this step
        self.num_whole = 0
        self.max_decode_ids = 0  # most ids sent for one request in a decode step (not whole)

    def apply(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids + out.preempted_request_ids:
            self.tables.drop(request_id)
            self.held.pop(request_id, None)
        for chunk in out.chunks:
            before = self.held.get(chunk.request_id)
            tables = self.tables.apply_chunk(chunk)
            expected = [list(t) for t in self.kv.group_block_ids(chunk.request_id)]
            assert tables == expected, f"step {self.scheduler.stats.num_steps}: {chunk}"  # (a)
            num_sent = sum(len(ids) for ids in chunk.new_tables)
            if chunk.block_offset == 0:
                # whole: only when the runner holds nothing for the request
                assert before is None, f"{chunk.request_id}: sent whole although the runner held it"
                self.num_whole += 1
            else:
                # (b): exactly the appended blocks of every group, nothing the runner held, so
                # bounded by the chunk's own tokens (and lookahead), not by the sequence's length
                assert chunk.block_offset == before
                assert num_sent == (len(tables[0]) - before) * len(tables)
                lookahead = self.scheduler.config.num_lookahead_tokens
                assert num_sent <= len(tables) * (-(-(chunk.num_tokens + lookahead) // BS) + 1)
                if chunk.num_tokens - chunk.num_spec_tokens == 1:
                    self.max_decode_ids = max(self.max_decode_ids, num_sent)
            self.held[chunk.request_id] = len(tables[0])
        # the runner holds tables for exactly the requests admitted and not since finished/preempted
        assert set(self.held) <= {r.request_id for r in self.scheduler.running}


def step(
    scheduler: Scheduler,
    keeper: TableKeeper,
    rng: random.Random | None = None,
    num_proposals: int = 0,
) -> SchedulerOutput:
    """One step: schedule, check the tables, then a stand-in runner samples token 9 (with
    `num_proposals` proposals of which a random number is accepted)."""
    out = scheduler.schedule()
    keeper.apply(out)
    sampled = []
    for chunk in out.chunks:
        if chunk.sample:
            accepted = rng.randint(0, chunk.num_spec_tokens) if rng else 0
            sampled.append(
                SampledTokens(
                    chunk.request_id,
                    (9,) * (accepted + 1),
                    num_accepted=accepted,
                    spec_token_ids=(9,) * num_proposals,
                )
            )
    scheduler.update(out, RunnerOutput(tuple(sampled)))
    scheduler.kv.check_invariants()
    return out


def make_scheduler(
    num_blocks: int,
    layout: KVLayout | None = None,
    budget: int = 256,
    lookahead: int = 0,
    prefix_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=2048,
        num_lookahead_tokens=lookahead,
    )
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching, layout=layout)
    return Scheduler(config, kv)


def request(request_id: str, prompt, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, tuple(prompt), params, max_tokens)


def test_a_long_decode_sends_each_block_once():
    scheduler = make_scheduler(num_blocks=600)
    keeper = TableKeeper(scheduler)
    for i in range(4):
        scheduler.add_request(request(f"r{i}", range(10 + i, 31 + i), 500))
    sizes = []
    while scheduler.has_unfinished():
        out = step(scheduler, keeper)
        sizes.append(sum(len(ids) for c in out.chunks if c.block_offset for ids in c.new_tables))
    assert keeper.num_whole == 4  # each request's tables sent whole once, at admission
    # a decode step sends at most one block per request, whatever the table's length (~130 blocks)
    assert keeper.max_decode_ids == 1
    assert max(sizes) <= 4
    # every block of every table was sent exactly once: 4 requests of 21 + 500 tokens
    assert sum(sizes) + 4 * 6 == 4 * -(-(21 + 499) // BS)


def test_a_sliding_window_group_sends_its_released_front_as_a_count():
    scheduler = make_scheduler(num_blocks=400, layout=window_layout(), budget=32)
    keeper = TableKeeper(scheduler)
    prompt = [5 + (i * 7) % 200 for i in range(70)]
    scheduler.add_request(request("a", prompt, 200))  # chunked prefill: 32-token chunks
    for _ in range(5):
        step(scheduler, keeper)
    # the same prompt again: a prefix-cache hit whose window tables start with null entries
    scheduler.add_request(request("b", prompt, 200))
    out = step(scheduler, keeper)
    (b,) = [c for c in out.chunks if c.request_id == "b"]
    assert b.block_offset == 0 and b.start_position > WINDOW
    assert b.num_released_blocks[0] == 0 and b.num_released_blocks[1] > 0
    assert b.new_tables[1][: b.num_released_blocks[1]] == (NULL_BLOCK,) * b.num_released_blocks[1]
    released = []
    while scheduler.has_unfinished():
        out = step(scheduler, keeper)
        released += [c.num_released_blocks for c in out.chunks if c.request_id == "a"]
    # the window's front moved on while decoding: the count grows, the full group never releases
    counts = [r[1] for r in released if r]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert all(r[0] == 0 for r in released if r)
    assert keeper.max_decode_ids == 3  # one new block per group at most


def test_preempted_requests_get_their_tables_whole_when_they_resume():
    scheduler = make_scheduler(num_blocks=40, prefix_caching=False)  # too few for all four
    keeper = TableKeeper(scheduler)
    for i in range(4):
        scheduler.add_request(request(f"r{i}", range(10 + i, 30 + i), 60))
    preempted, resumed = set(), set()
    while scheduler.has_unfinished():
        out = step(scheduler, keeper)
        preempted.update(out.preempted_request_ids)
        resumed.update(c.request_id for c in out.chunks if c.request_id in preempted)
    assert scheduler.stats.num_preemptions > 0 and resumed
    assert keeper.num_whole == 4 + scheduler.stats.num_preemptions
    assert keeper.max_decode_ids == 1


def test_rejected_proposals_roll_back_the_count_not_the_table():
    scheduler = make_scheduler(num_blocks=300, lookahead=4)
    keeper = TableKeeper(scheduler)
    rng = random.Random(0)
    for i in range(3):
        scheduler.add_request(request(f"r{i}", range(10 + i, 27 + i), 120))
    while scheduler.has_unfinished():
        step(scheduler, keeper, rng, num_proposals=4)
    # a verifying step appends what its tokens and the lookahead need: at most 3 blocks of 4
    assert 0 < keeper.max_decode_ids <= 3


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    hybrid=st.booleans(),
    num_blocks=st.integers(30, 120),  # x2 with a window group: the largest request always fits
    budget=st.sampled_from([8, 24, 64]),
    lookahead=st.sampled_from([0, 3]),
)
def test_the_runners_tables_follow_the_kv_manager_under_random_use(
    seed, hybrid, num_blocks, budget, lookahead
):
    """Arrivals, shared prompts (prefix hits), n > 1 samples, aborts, proposals accepted at random,
    preemption in a small pool, chunked prefill, with and without a window group."""
    rng = random.Random(seed)
    layout = window_layout() if hybrid else None
    scheduler = make_scheduler(num_blocks * (2 if hybrid else 1), layout, budget, lookahead)
    keeper = TableKeeper(scheduler)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    for index in range(40):
        if rng.random() < 0.3:
            params = SamplingParams(
                max_tokens=rng.randint(1, 40), ignore_eos=True, n=rng.choice([1, 2])
            )
            scheduler.add_request(
                Request(f"q{index}", tuple(rng.choice(prompts)), params, params.max_tokens)
            )
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        step(scheduler, keeper, rng, num_proposals=lookahead)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        step(scheduler, keeper, rng, num_proposals=lookahead)
    assert not scheduler.has_unfinished()


def test_a_change_that_does_not_fit_the_runners_tables_is_refused():
    tables = BlockTables(1)
    with pytest.raises(TableChangeError, match="does not hold"):
        tables.apply("x", 3, ((7,),))
    tables.apply("x", 0, ((4, 5, 6),))
    with pytest.raises(TableChangeError, match="a change at block 2 of a table of 3 blocks"):
        tables.apply("x", 2, ((7,),))
    with pytest.raises(TableChangeError, match="2 KV groups"):
        tables.apply("x", 3, ((7,), ()))
    sender = TableSender([False])
    sender.whole("x", [[4, 5, 6]])
    with pytest.raises(TableChangeError, match="shrank from 3 to 2"):
        sender.change("x", [[4, 5]])


def test_tensor_parallel_ranks_rebuild_the_tables_from_the_same_operations():
    """Rank 0 forwards its changes as operations (plain lists after JSON, for other hosts)."""
    rank = BlockTables(2)
    rank.apply_ops(
        [
            [CHANGE, "a", 0, [[1, 2], [3, 4]], []],
            [CHANGE, "a", 2, [[5], [6]], [0, 1]],
            [CHANGE, "b", 0, [[7], [8]], []],
            [DROP, "b"],
        ]
    )
    assert rank.get("a") == [[1, 2, 5], [NULL_BLOCK, 4, 6]] and "b" not in rank
