"""kvserve/sched/scheduler.py on its own (no model, no runner): a stand-in runner samples the tokens a
test names. The scheduler decides every stop and its reason, fans n > 1 out and holds the siblings,
keeps a step within its token budget, and preempts the newest request when the cache runs out.
Fairness among client requests: tests/sched/test_scheduler_fairness.py."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.block_tables import BlockTables
from kvserve.core.errors import InvalidRequestError
from kvserve.core.outputs import RunnerOutput, SampledTokens, StopStringMatch
from kvserve.core.request import Request, sample_request_id
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.scheduler import Scheduler

EOS = 2
PROMPT = [5 + (i * 7) % 200 for i in range(21)]  # one full block of 16 and a part


def _scheduler(num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128)
    return Scheduler(config, KVCacheManager(num_blocks, 16, enable_prefix_caching=False))


def _request(params: SamplingParams, request_id: str = "r") -> Request:
    return Request(request_id, tuple(PROMPT), params, params.max_tokens, frozenset({EOS}))


def _step(scheduler: Scheduler, tokens: dict[str, int]):
    """One scheduler step with a stand-in runner that samples `tokens[request id]` (default 9)."""
    out = scheduler.schedule(now=0.0)
    sampled = tuple(
        SampledTokens(c.request_id, (tokens.get(c.request_id, 9),)) for c in out.chunks if c.sample
    )
    return out, scheduler.update(out, RunnerOutput(sampled))


@pytest.mark.parametrize(
    ("params", "token", "reason", "stop_reason"),
    [
        (SamplingParams(max_tokens=8), EOS, "stop", EOS),
        (SamplingParams(max_tokens=8, stop_token_ids=(11,)), 11, "stop", 11),
        (SamplingParams(max_tokens=1), 9, "length", None),
        (SamplingParams(max_tokens=8, ignore_eos=True), EOS, None, None),
    ],
)
def test_the_scheduler_decides_the_stop_and_its_reason(params, token, reason, stop_reason):
    scheduler = _scheduler()
    scheduler.add_request(_request(params))
    _, (update,) = _step(scheduler, {"r": token})
    assert (update.finish_reason, update.stop_reason) == (reason, stop_reason)


def test_the_scheduler_fans_out_n_samples_and_holds_the_siblings():
    scheduler = _scheduler()
    params = SamplingParams(n=3, max_tokens=4, seed=10)
    ids = scheduler.add_request(_request(params))
    assert ids == [sample_request_id("r", i, 3) for i in range(3)] == ["r-0", "r-1", "r-2"]
    assert scheduler.num_waiting == 3
    samples = [scheduler.requests[i] for i in ids]
    assert [s.sampling_params.seed for s in samples] == [10, 11, 12]
    assert [s.prompt_source_id for s in samples] == [None, "r-0", "r-0"]
    tables = BlockTables(1)  # what the runner rebuilds from the steps' changes
    out, _ = _step(scheduler, {})
    assert [n.request_id for n in out.new_requests] == ["r-0"]  # siblings wait for the prompt
    assert scheduler.num_waiting == 2
    for chunk in out.chunks:
        tables.apply_chunk(chunk)
    out, _ = _step(scheduler, {})
    assert [n.request_id for n in out.new_requests] == ["r-1", "r-2"]
    # they share sample 0's full prompt block by reference (no prefix caching here)
    blocks = {c.request_id: tables.apply_chunk(c)[0] for c in out.chunks}
    assert blocks["r-1"][0] == blocks["r-2"][0] == blocks["r-0"][0]
    assert {c.request_id: c.start_position for c in out.chunks}["r-1"] == 16


def test_aborting_a_fanned_out_request_ends_the_held_samples_too():
    scheduler = _scheduler()
    ids = scheduler.add_request(_request(SamplingParams(n=3, max_tokens=4)))
    scheduler.finish_requests(ids, scheduler.requests["r-0"].status.FINISHED_ABORTED)
    assert not scheduler.has_unfinished() and scheduler.num_waiting == 0


# --- chunked prefill and preemption -----------------------------------------------------------------


def test_a_step_keeps_within_its_token_budget_and_chunks_a_long_prompt():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    scheduler = Scheduler(config, KVCacheManager(64, 16, enable_prefix_caching=False))
    long_prompt = tuple(range(10, 110))  # 100 tokens: four steps of at most 32
    scheduler.add_request(
        Request("long", long_prompt, SamplingParams(max_tokens=2), 2, frozenset())
    )
    starts = []
    while True:
        out, updates = _step(scheduler, {})
        (chunk,) = out.chunks
        assert out.num_scheduled_tokens <= 32
        starts.append(chunk.start_position)
        if chunk.sample:
            break
        assert not updates or not updates[0].new_token_ids  # no token before the prompt ends
    assert starts == [0, 32, 64, 96]


def test_prompt_tokens_beside_decoding_rows_keep_within_their_cap():
    """With decoding rows in the step, prompt chunks (running or admitted) hold at most
    `max_prompt_tokens_beside_decode` tokens; a step of prompts only takes the whole budget."""
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
        max_prompt_tokens_beside_decode=48,
    )  # fmt: skip
    scheduler = Scheduler(config, KVCacheManager(64, 16, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    scheduler.add_request(Request("a", tuple(range(10, 110)), params, 50, frozenset()))
    scheduler.add_request(Request("b", tuple(range(10, 60)), params, 50, frozenset()))
    out, _ = _step(scheduler, {})  # no row decodes yet: both prompts whole, 150 tokens
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 100), ("b", 50)]
    scheduler.add_request(Request("c", tuple(range(10, 110)), params, 50, frozenset()))
    scheduler.add_request(Request("d", tuple(range(10, 30)), params, 50, frozenset()))
    shapes = []
    while scheduler.requests["c"].num_output_tokens == 0 or "d" not in [
        r.request_id for r in scheduler.running
    ]:
        out, _ = _step(scheduler, {})
        decode = [c.num_tokens for c in out.chunks if c.request_id in ("a", "b")]
        prompt = {c.request_id: c.num_tokens for c in out.chunks if c.request_id in ("c", "d")}
        assert decode == [1, 1]  # the decoding rows run in every step
        shapes.append(prompt)
    # c's 100 tokens in chunks of 48, 48, 4; d (20 tokens) is admitted with c's last 4
    assert shapes == [{"c": 48}, {"c": 48}, {"c": 4, "d": 20}]
    assert all(sum(p.values()) <= 48 for p in shapes)


def test_the_prompt_cap_is_validated():
    with pytest.raises(InvalidRequestError, match="max_prompt_tokens_beside_decode"):
        SchedulerConfig(max_prompt_tokens_beside_decode=-1)


def test_out_of_blocks_the_newest_running_request_is_preempted_and_recomputed():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128)
    # 4 blocks of 16: two 21-token prompts take 2 blocks each; the first to grow past 32 tokens needs
    # a fifth block, so the newest running request gives its blocks back.
    scheduler = Scheduler(config, KVCacheManager(4, 16, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    scheduler.add_request(_request(params, "old"))
    scheduler.add_request(_request(params, "new"))
    preempted = []
    for _ in range(15):
        out, _ = _step(scheduler, {})
        preempted += out.preempted_request_ids
        if preempted:
            break
    assert preempted == ["new"]
    assert scheduler.requests["new"].num_computed_tokens == 0  # recompute from the start
    assert [r.request_id for r in scheduler.running] == ["old"]
    assert scheduler.stats.num_preemptions == 1


class _PairStop:
    """A stop check without text: a "stop string" is the token pair (6, 7), matched across steps as a
    detokenizer matches text; records what the scheduler offered it."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}
        self.calls: list[tuple[str, tuple[int, ...], bool]] = []

    def __call__(self, request_id: str, new_token_ids: tuple[int, ...], finishing: bool):
        self.calls.append((request_id, new_token_ids, finishing))
        seen = self.seen.setdefault(request_id, [])
        for used, token_id in enumerate(new_token_ids, 1):
            seen.append(token_id)
            if seen[-2:] == [6, 7]:
                return StopStringMatch(used, "<6,7>")
        return None


def _step_tokens(scheduler: Scheduler, token_ids: tuple[int, ...], stop_check, **sampled):
    out = scheduler.schedule(now=0.0)
    runner_output = RunnerOutput(
        tuple(SampledTokens(c.request_id, token_ids, **sampled) for c in out.chunks if c.sample)
    )
    return scheduler.update(out, runner_output, stop_check)


def test_a_stop_string_ends_the_request_at_the_token_completing_it():
    """Several tokens in one step (a speculative step commits several): those after the stop string
    are neither reported nor kept, and the request ends here with the string as its reason."""
    scheduler, check = _scheduler(), _PairStop()
    scheduler.add_request(_request(SamplingParams(max_tokens=8)))
    (update,) = _step_tokens(scheduler, (6,), check)
    assert update.finish_reason is None and update.new_token_ids == (6,)
    (update,) = _step_tokens(scheduler, (7, 9, 9), check)
    assert update.new_token_ids == (7,)
    assert (update.finish_reason, update.stop_reason) == ("stop", "<6,7>")
    assert check.calls == [("r", (6,), False), ("r", (7, 9, 9), False)]
    assert not scheduler.has_unfinished() and scheduler.kv.num_free_blocks == 32
    assert scheduler.schedule().finished_request_ids == ("r",)  # the runner drops its state


def test_a_stop_string_wins_over_length_in_the_same_step():
    scheduler, check = _scheduler(), _PairStop()
    request = _request(SamplingParams(max_tokens=2))
    scheduler.add_request(request)
    _step_tokens(scheduler, (6,), check)
    (update,) = _step_tokens(scheduler, (7,), check)
    assert (update.finish_reason, update.stop_reason) == ("stop", "<6,7>")
    assert check.calls[-1] == ("r", (7,), True)  # told it ends, so held-back text is released
    assert request.output_token_ids == [6, 7]


def test_tokens_after_eos_never_reach_the_stop_check():
    scheduler, check = _scheduler(), _PairStop()
    request = _request(SamplingParams(max_tokens=8))
    scheduler.add_request(request)
    (update,) = _step_tokens(scheduler, (6, EOS, 7), check)
    assert (update.finish_reason, update.stop_reason) == ("stop", EOS)
    assert check.calls == [("r", (6, EOS), True)] and request.output_token_ids == [6, EOS]


def test_the_grammar_end_is_reported_by_the_runner_and_decided_here():
    scheduler = _scheduler()
    scheduler.add_request(_request(SamplingParams(max_tokens=8)))
    (update,) = _step_tokens(scheduler, (9,), None, grammar_ended=True)
    assert (update.finish_reason, update.stop_reason, update.grammar_complete) == (
        "stop",
        None,
        True,
    )
    assert not scheduler.has_unfinished()
