"""Fair admission (docs/scheduling.md "Fairness"): samples carry the client request they belong to
(`Request.group`; the server sets it to its request id), and a waiting sample of a request with fewer
running samples is admitted before more samples of a request that already runs some. Ungrouped samples
(offline `LLM.generate`) keep first come, first served. Figures are step counts, never wall-clock."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.core.outputs import RunnerOutput, SampledTokens
from kvserve.core.request import Request
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.scheduler import Scheduler

PROMPT = tuple(range(5, 25))


def scheduler(max_num_seqs: int = 4) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=256)
    return Scheduler(config, KVCacheManager(256, 16, enable_prefix_caching=False))


def request(request_id: str, group: str | None, n: int = 1, max_tokens: int = 8) -> Request:
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, PROMPT, params, max_tokens, frozenset(), group=group)


def step(s: Scheduler) -> list[str]:
    """One step with a runner that samples token 9 for every sampling chunk; the ids admitted."""
    out = s.schedule(now=0.0)
    sampled = tuple(SampledTokens(c.request_id, (9,)) for c in out.chunks if c.sample)
    s.update(out, RunnerOutput(sampled))
    return [n.request_id for n in out.new_requests]


@pytest.mark.parametrize("grouped", [True, False])
def test_a_later_request_is_admitted_before_more_of_a_running_ones_prompts(grouped):
    s = scheduler()
    for i in range(3):  # one API call with three prompts
        s.add_request(request(f"a-p{i}", "a" if grouped else None))
    s.add_request(request("b", "b" if grouped else None))
    admitted = step(s)
    if grouped:
        assert admitted == ["a-p0", "b", "a-p1", "a-p2"]
    else:  # first come, first served
        assert admitted == ["a-p0", "a-p1", "a-p2", "b"]


def test_a_later_request_overtakes_released_siblings():
    """n = 8: samples 1..7 wait for sample 0's first token, then queue; a request arriving after
    them is admitted at the next free slot, before the siblings that no slot was left for."""
    s = scheduler(max_num_seqs=4)
    s.add_request(request("a", "a", n=8))
    assert step(s) == ["a-0"]  # sample 0 computes the prompt and samples its first token
    s.add_request(request("b", "b"))
    admitted = step(s)
    assert admitted[0] == "b" and len(admitted) == 3  # b, then two siblings (4 slots)
    assert s.num_waiting == 5


def test_an_api_call_of_many_samples_delays_a_later_stream_by_steps_not_by_its_size(llama_dir):
    """256 samples (16 prompts x n=16, 24 tokens each) and then one more request on an engine of 16
    slots: the later request's first token comes within two steps of its arrival; ungrouped (first
    come, first served) it waits behind every earlier sample."""
    llm = LLM(str(llama_dir), num_blocks=512, max_num_seqs=16)
    engine = llm.engine
    big = SamplingParams(n=16, max_tokens=24, ignore_eos=True)
    small = SamplingParams(max_tokens=4, ignore_eos=True)
    steps_to_first_token = {}
    for grouped in (True, False):
        for i in range(16):
            engine.add_request(f"{grouped}-a-p{i}", list(PROMPT) + [i], big,
                               group="a" if grouped else None)  # fmt: skip
        engine.step()
        engine.add_request(f"{grouped}-b", list(PROMPT), small, group="b" if grouped else None)
        steps = 0
        while True:
            steps += 1
            outputs = engine.step()
            if any(o.request_id == f"{grouped}-b" and o.outputs[0].token_ids for o in outputs):
                break
        steps_to_first_token[grouped] = steps
        while engine.has_unfinished_requests():
            engine.step()
    print("steps to the later request's first token", steps_to_first_token)
    assert steps_to_first_token[True] <= 2, steps_to_first_token
    assert steps_to_first_token[False] > 10 * steps_to_first_token[True], steps_to_first_token
