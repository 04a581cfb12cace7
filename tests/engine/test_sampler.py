"""The sampler against analytic distributions, and sampling behaviour through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.runner.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    filter_logits,
    greedy_argmax,
    process_logits,
)

LOGITS = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))


def batch(**overrides) -> SamplingBatch:
    rows = overrides.pop("rows", 1)
    values = dict(
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.long),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        generators=[None] * rows,
        num_logprobs=[None] * rows,
    )
    values.update(overrides)
    return SamplingBatch(**values)


def support(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().squeeze(1).tolist()


def test_top_k_top_p_min_p_supports():
    assert support(filter_logits(LOGITS, batch(top_k=torch.tensor([3])))) == [0, 1, 2]
    # top_p 0.7: 0.4 + 0.25 = 0.65 < 0.7, so the third token is needed to reach it.
    assert support(filter_logits(LOGITS, batch(top_p=torch.tensor([0.7])))) == [0, 1, 2]
    assert support(filter_logits(LOGITS, batch(top_p=torch.tensor([0.6])))) == [0, 1]
    assert support(filter_logits(LOGITS, batch(top_p=torch.tensor([0.3])))) == [0]
    # min_p 0.3: keep p >= 0.3 * 0.4 = 0.12
    assert support(filter_logits(LOGITS, batch(min_p=torch.tensor([0.3])))) == [0, 1, 2]
    # temperature 2 flattens: p ~ sqrt(p0) renormalised
    scaled = filter_logits(LOGITS, batch(temperature=torch.tensor([2.0]))).softmax(-1)
    expected = LOGITS.div(2).softmax(-1)
    torch.testing.assert_close(scaled, expected)


def test_sampling_matches_the_filtered_distribution():
    """200k draws through CDF inversion: empirical frequencies within sampling noise of p."""
    num = 200_000
    sampler = Sampler(seed=123)
    logits = LOGITS.expand(num, -1).contiguous()
    b = batch(
        rows=num, top_k=torch.full((num,), 4, dtype=torch.long), temperature=torch.full((num,), 0.8)
    )
    tokens, _ = sampler(logits, b)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    empirical = counts / num
    p = LOGITS[0, :4].div(0.8).softmax(-1).double()
    expected = torch.cat([p, torch.zeros(2, dtype=torch.float64)])
    assert counts[4:].sum() == 0, "top_k=4 must never sample tokens 4 and 5"
    # Per-token 5-sigma binomial bound.
    sigma = torch.sqrt(expected * (1 - expected) / num)
    assert torch.all((empirical - expected).abs() <= 5 * sigma + 1e-12), (empirical, expected)


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    b = batch(
        repetition_penalty=torch.tensor([2.0]),
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
        output_counts=torch.tensor([[2.0, 1.0, 0.0, 0.0]]),
        prompt_mask=torch.tensor([[False, False, True, False]]),
    )
    out = apply_penalties(logits, b)
    # token 0: 2/2 - 0.25*2 - 0.5 = 0; token 1: -1*2 - 0.25 - 0.5 = -2.75; token 2 (prompt): 0.5/2; token 3.
    torch.testing.assert_close(out, torch.tensor([[0.0, -2.75, 0.25, 1.0]]))


@pytest.mark.parametrize("penalty", [1e-20, 1e-38, 1e-45, 1e-46, 0.0])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0, 1e30])
def test_a_tiny_repetition_penalty_takes_its_limit(penalty, temperature):
    """logit / penalty overflows float32 for a tiny penalty (1e-46 and 0 are stored as 0). The oracle is the
    same arithmetic in float64 (a penalty of 0 taken as 1e-300, its limit from above), divided by the
    temperature: one-hot on the largest seen positive logit (token 3) except where a huge temperature
    flattens 1e-20's scaled logits. Before the fix the greedy row took the first id that reached inf
    (token 1) and a random row drew from a NaN distribution (token 6)."""
    logits = torch.tensor([[-3.0, 1.5, 0.2, 2.5, -0.5, 3.0, 2.4]])
    seen = torch.tensor([[True, True, True, True, True, False, False]])
    oracle = logits.double().clone()
    positive = seen & (logits > 0)
    oracle[positive] = oracle[positive] / max(penalty, 1e-300)
    oracle[seen & (logits <= 0)] *= penalty

    def penalised(rows: int, **overrides) -> SamplingBatch:
        return batch(
            rows=rows,
            temperature=torch.full((rows,), temperature),
            repetition_penalty=torch.full((rows,), penalty),
            presence_penalty=torch.zeros(rows),
            frequency_penalty=torch.zeros(rows),
            output_counts=torch.zeros(rows, 7),
            prompt_mask=seen.expand(rows, -1),
            **overrides,
        )

    processed = process_logits(logits, penalised(1, host_penalty_below_one=True))
    assert not processed.isnan().any()
    if temperature == 0:
        assert greedy_argmax(processed).item() == 3
        return
    expected = (oracle / max(temperature, 1e-5)).softmax(-1)
    probs = filter_logits(processed, penalised(1)).softmax(-1)
    torch.testing.assert_close(probs.double(), expected)
    tokens, _ = Sampler(seed=7)(logits.expand(64, -1), penalised(64))
    if expected[0, 3] == 1.0:
        assert tokens == [3] * 64
    else:
        assert len(set(tokens)) > 1


def test_the_overflow_limit_keeps_a_token_the_masks_allow():
    """The largest seen logit (token 3) is banned: the limit goes to the largest one still allowed (1)."""
    logits = torch.tensor([[1.5, 2.0, -1.0, 2.5]])
    b = batch(
        repetition_penalty=torch.tensor([1e-45]),
        presence_penalty=torch.zeros(1),
        frequency_penalty=torch.zeros(1),
        output_counts=torch.zeros(1, 4),
        prompt_mask=torch.tensor([[True, True, True, True]]),
        banned=(torch.tensor([0]), torch.tensor([3])),
    )
    processed = process_logits(logits, b)
    assert processed.tolist() == [[float("-inf"), 0.0, float("-inf"), float("-inf")]]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_blocks=128)


PROMPT = [10, 20, 30, 40, 50]


def test_same_seed_same_output_and_batch_independent(llm):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    again = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batched = llm.generate([[1, 2, 3], PROMPT, [4, 5]], [others, params, others])[1]
    other_seed = llm.generate([PROMPT], params.with_updates(seed=8))[0].outputs[0].token_ids
    assert alone == again == batched.outputs[0].token_ids
    assert other_seed != alone


def test_a_tiny_repetition_penalty_through_the_engine(llm):
    """Through the runner's batch (its host flag): 1e-45 and 1e-46 (0 in float32) give what 1e-20 gives,
    whose arithmetic stays finite, greedy and at temperature 1; before the fix a random row stopped at
    once on a NaN distribution."""
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True)
        outputs = [
            llm.generate([PROMPT], params.with_updates(repetition_penalty=rp))[0].outputs[0]
            for rp in (1e-20, 1e-45, 1e-46)
        ]
        assert len(outputs[0].token_ids) == 8
        assert all(o.token_ids == outputs[0].token_ids for o in outputs), outputs


def test_logprobs_shape_and_values(llm):
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    completion = llm.generate([PROMPT], params)[0].outputs[0]
    assert len(completion.logprobs) == 5
    reference = llm.engine.score(PROMPT + completion.token_ids[:-1]).log_softmax(-1)
    for i, lp in enumerate(completion.logprobs):
        row = reference[len(PROMPT) - 1 + i]
        assert lp.token_id == completion.token_ids[i]
        assert lp.rank == 1  # greedy picks the most likely token
        assert math.isclose(lp.logprob, row[lp.token_id].item(), abs_tol=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    assert math.isclose(
        completion.cumulative_logprob, sum(lp.logprob for lp in completion.logprobs)
    )


def test_min_tokens_and_eos(llm):
    # Bias EOS (id 2) so it wins every step: min_tokens holds it back for exactly 4 tokens.
    params = SamplingParams(max_tokens=10, temperature=0, min_tokens=4, logit_bias={2: 100.0})
    completion = llm.generate([PROMPT], params)[0].outputs[0]
    assert completion.token_ids[-1] == 2 and len(completion.token_ids) == 5
    assert completion.finish_reason == "stop" and completion.stop_reason == 2
    ignored = llm.generate([PROMPT], params.with_updates(ignore_eos=True, min_tokens=0))[0].outputs[
        0
    ]
    assert ignored.token_ids == [2] * 10 and ignored.finish_reason == "length"


def test_stop_token_ids(llm):
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[7], logit_bias={7: 100.0})
    completion = llm.generate([PROMPT], params)[0].outputs[0]
    assert completion.token_ids == [7] and completion.finish_reason == "stop"


def test_n_samples_share_prompt_and_differ(llm):
    prompt = list(range(3, 40))  # 37 tokens: two full blocks
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    output = llm.generate([prompt], params)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    # samples 1 and 2 reused sample 0's full prompt blocks
    assert [c.num_cached_tokens for c in output.outputs][1:] == [32, 32]
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_prompt_blocks_by_reference(llama_dir, prefix_caching):
    llm = LLM(str(llama_dir), num_blocks=64, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    prompt = list(range(3, 40))  # 37 tokens: two full blocks and a partial one
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=2, ignore_eos=True)
    engine.add_request("r", prompt, params)
    shared = False
    while engine.has_unfinished_requests():
        engine.step()
        tables = [engine.kv_manager.block_ids(f"r-{i}") for i in range(3)]
        if all(tables):
            assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full prompt blocks
            assert len({t[2] for t in tables}) == 3  # each computes its own partial block
            ref_counts = [engine.kv_manager.pool.blocks[b].ref_cnt for b in tables[0][:2]]
            assert ref_counts == [3, 3]
            shared = True
        engine.check_invariants()
    assert shared
    assert engine.num_free_blocks() == 64


def test_host_flags_equal_the_tensor_path():
    """The flags the runner knows on the host (greedy rows, top-k / top-p / min-p in use) agree with
    the sampling tensors, and sampling with them gives the same tokens as reading the tensors (the
    oracle: the same batch with every host flag cleared, same seeds)."""
    from dataclasses import replace

    from kvserve.runner.batch import RequestState, build_sampling_batch

    cases = [
        [SamplingParams(temperature=0)] * 3,
        [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5)],
        [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0)],
        [SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=0.5)],
        [SamplingParams(temperature=0.8, top_p=0.999999999)],  # 1.0 in float32: top-p off
        [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=0.9, top_k=3)],
    ]
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    for params in cases:

        def states(params=params):
            return [RequestState(p, (1, 2), frozenset(), _generator(p), 16, [3]) for p in params]

        with_flags = build_sampling_batch(
            [(s, 0, 1) for s in states()], (), vocab, torch.device("cpu"), None
        )
        cleared = replace(
            build_sampling_batch([(s, 0, 1) for s in states()], (), vocab, "cpu", None),
            host_all_greedy=None,
            host_random_rows=None,
            host_use_top_k=None,
            host_use_top_p=None,
            host_use_min_p=None,
        )
        assert with_flags.all_greedy == cleared.all_greedy
        assert with_flags.random_rows() == cleared.random_rows()
        for name in ("top_k", "top_p", "min_p"):
            assert with_flags.uses(name) == cleared.uses(name), (params, name)
        rows = logits[: len(params)]
        tokens_flags, _ = Sampler(seed=5)(rows, with_flags)
        tokens_tensors, _ = Sampler(seed=5)(rows, cleared)
        assert tokens_flags == tokens_tensors


def _generator(p: SamplingParams) -> torch.Generator | None:
    if p.seed is None:
        return None
    return torch.Generator().manual_seed(p.seed)


def test_greedy_argmax_equals_torch_argmax():
    """The CPU fast path (numpy's argmax) against torch.argmax: random rows, ties (the first index
    wins), rows of -inf but one, an all -inf row, NaN (counted as the maximum), a strided view."""
    from kvserve.runner.sampler import greedy_argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=gen)
    x[1, [10, 500, 900]] = 50.0  # a tie
    x[2] = float("-inf")
    x[2, 777] = 0.0
    x[3] = float("-inf")
    x[4, [20, 30]] = float("nan")
    x[5] = 1.0  # every value tied
    for logits in (x, x[:, ::3], x[[0, 1]]):
        got = greedy_argmax(logits)
        assert got.dtype == torch.long and got.shape == (logits.shape[0],)
        assert torch.equal(got, logits.argmax(dim=-1))
