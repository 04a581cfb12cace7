"""The per-step host shortcuts (docs/performance.md, "Host work per step") give what the general
paths give: the decode-row metadata (the numpy route) equals the general route's, the greedy fast path the
sampler's tokens, finished-only snapshots the full ones, the Rust decode transformers' decode."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.detokenizer import _rust_decoder
from kvserve.model.attention import _general_metadata, build_attention_metadata
from tests.checkpoints import build_gpt2_tokenized_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("host_path")
    build_gpt2_tokenized_checkpoint(path)
    return LLM(str(path), max_num_seqs=8, seed=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_metadata_equals_the_general_metadata(block_size):
    """A CPU step of decode rows takes the numpy route; it builds what the general route builds."""
    rng = random.Random(block_size)
    for _ in range(20):
        chunks = []
        for _ in range(rng.randint(1, 9)):
            start = rng.randint(0, 70)
            blocks = tuple(
                rng.sample(range(100), -(-(start + 1) // block_size) + rng.randint(0, 2))
            )
            chunks.append((start, (rng.randint(0, 999),), blocks))
        meta = build_attention_metadata([(s, 1, b) for s, _, b in chunks], block_size, "cpu")
        ref = _general_metadata([(s, 1, list(b)) for s, _, b in chunks], block_size, "cpu")
        assert meta.multi == () and meta.block_size == block_size
        for got, want in [
            (meta.slot_mapping, ref.slot_mapping),
            (meta.single.rows, ref.single.rows),
            (meta.single.block_table, ref.single.block_table),
            (meta.single.context_lens, ref.single.context_lens),
        ]:
            assert got.dtype == want.dtype and got.is_contiguous()
            assert torch.equal(got, want)
        assert meta.single.max_context == ref.single.max_context


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_fast_path_equals_the_sampler(llm, monkeypatch):
    """Plain greedy rows skip the sampler; rows with a processor (bias, min_tokens, penalties,
    logprobs) still go through it. Both give what the sampler gives for every row."""
    prompts = [[11, 12, 13], [40, 41], [7, 8, 9, 10]]
    cases = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, logit_bias={5: 3.0}, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=6),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
    ]
    fast = [_tokens(llm.generate(prompts, p)) for p in cases]
    fast_mixed = _tokens(llm.generate(prompts * 2, cases[:3] + cases[:1] + cases[3:]))
    from kvserve.runner import batch as batch_mod

    monkeypatch.setattr(batch_mod.RequestState, "plain_greedy", lambda self, n: False)
    slow = [_tokens(llm.generate(prompts, p)) for p in cases]
    slow_mixed = _tokens(llm.generate(prompts * 2, cases[:3] + cases[:1] + cases[3:]))
    assert fast == slow
    assert fast_mixed == slow_mixed


def test_plain_greedy_flags():
    from kvserve.runner.batch import RequestState

    def state(**params):
        return RequestState(SamplingParams(**params), (1, 2), frozenset({2}), None, 10)

    assert state(temperature=0).plain_greedy(0)
    assert not state(temperature=0.7).plain_greedy(0)
    assert not state(temperature=0, logit_bias={3: 1.0}).plain_greedy(0)
    assert not state(temperature=0, presence_penalty=0.5).plain_greedy(0)
    assert not state(temperature=0, logprobs=0).plain_greedy(0)
    banned = state(temperature=0, min_tokens=3)
    assert not banned.plain_greedy(2) and banned.plain_greedy(3)
    assert state(temperature=0, min_tokens=3, ignore_eos=True).plain_greedy(0)  # nothing banned
    assert not state(temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[4]).plain_greedy(
        0
    )
    grammar = state(temperature=0)
    grammar.grammar = object()
    assert not grammar.plain_greedy(5)


def test_finished_only_snapshots_equal_the_last_full_snapshot(llm):
    params = [
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=2, ignore_eos=True),
    ]
    prompts = [[5, 6, 7], [9, 10]]
    finished = llm.generate(prompts, params)  # run_until_done: finished-only snapshots
    last = {}
    for changed in llm.generate_steps(prompts, params):  # a snapshot every step
        last.update(changed)
    for i, out in enumerate(finished):
        full = last[i]
        assert full.finished and out.finished
        for a, b in zip(out.outputs, full.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
            assert len(a.metrics.token_times) == len(b.metrics.token_times) == len(a.token_ids)


def test_rust_decode_equals_transformers_decode(llm):
    tokenizer = llm.tokenizer
    backend = _rust_decoder(tokenizer)
    assert backend is not None  # GPT-2's fast tokenizer takes the direct path
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    for _ in range(50):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 8))]
        ids += special if rng.random() < 0.3 else []
        for skip in (False, True):
            assert backend.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )


def test_rust_decode_is_not_used_where_transformers_cleans_up_spaces(llm):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llm.args.model, clean_up_tokenization_spaces=True)
    assert _rust_decoder(tokenizer) is None
    assert _rust_decoder(object()) is None


def test_sampling_inputs_are_built_once_per_request(monkeypatch):
    """A large logit_bias, a long stop_token_ids list under min_tokens, and penalty inputs are turned into
    tensors once per request (the output ids grow by the new tokens only); fuzzing found a
    full-vocabulary bias rebuilt from Python at every step (0.36 s per step for everyone). Each step's
    batch equals one built from scratch, for a request with two rows (a speculative verify) too, and until
    and after min_tokens runs out; the Python values converted per step do not grow with those lists."""
    from kvserve.runner.batch import RequestState, build_sampling_batch

    vocab, device = 6000, torch.device("cpu")
    rng = random.Random(0)
    bias = tuple((t, rng.uniform(-5, 5)) for t in rng.sample(range(vocab), 5000))
    stops = list(range(1000, 6000))
    penalised = SamplingParams(
        max_tokens=30, min_tokens=3, stop_token_ids=stops, logit_bias=dict(bias),
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, temperature=0,
    )  # fmt: skip
    biased = SamplingParams(
        max_tokens=30, min_tokens=4, stop_token_ids=stops, logit_bias=dict(bias), temperature=0
    )
    plain = SamplingParams(max_tokens=30, temperature=0)
    prompt = tuple(rng.randrange(vocab) for _ in range(50))
    states = [RequestState(p, prompt, frozenset({2}), None, 30) for p in (plain, penalised, biased)]
    converted = []
    real_tensor = torch.tensor

    def counting_tensor(data, *args, **kwargs):
        converted.append(len(data) if isinstance(data, list | tuple) else 1)
        return real_tensor(data, *args, **kwargs)

    num_new = 0
    for step in range(6):
        # rows: plain, penalised, and the biased request twice (offsets 0 and 1, as a verify step)
        n = [len(s.output_token_ids) for s in states]
        rows = [
            (states[0], 0, n[0]),
            (states[1], 0, n[1]),
            (states[2], 0, n[2]),
            (states[2], 1, n[2] + 1),
        ]
        monkeypatch.setattr(torch, "tensor", counting_tensor)
        converted.clear()
        batch = build_sampling_batch(rows, (), vocab, device, lambda logits, rows: None)
        per_step = sum(converted)
        monkeypatch.setattr(torch, "tensor", real_tensor)
        # From scratch: what the batch must do to a row of zeros.
        want = torch.zeros(4, vocab)
        for row in (1, 2, 3):
            for t, b in bias:
                want[row, t] += b
            if rows[row][2] < rows[row][0].params.min_tokens:
                want[row, [2, *stops]] = float("-inf")
        got = torch.zeros(4, vocab)
        got.index_put_(batch.bias[:2], batch.bias[2], accumulate=True)
        if batch.banned is not None:
            got[batch.banned] = float("-inf")
        assert torch.equal(got, want), step
        counts = torch.zeros(vocab)
        for t in states[1].output_token_ids:
            counts[t] += 1
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[list(prompt)] = True
        assert torch.equal(batch.output_counts[1], counts)
        assert torch.equal(batch.prompt_mask[1], mask)
        if (
            step
        ):  # the rows' scalars and the penalised request's new tokens, not the 5000-long lists
            assert per_step < 40 + num_new, (per_step, num_new)
        num_new = rng.choice((1, 70))
        for state in states:
            state.output_token_ids.extend(rng.randrange(vocab) for _ in range(num_new))
