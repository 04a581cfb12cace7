"""Speculative decoding: exact greedy output for both proposers, stochastic exactness on one conditional
distribution, KV rollback (and a test that catches its absence), vocabulary checks."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.core.errors import ModelLoadError
from kvserve.runner.spec_decode import NgramProposer, verify_greedy, verify_stochastic
from kvserve.sched.scheduler import Scheduler
from tests.checkpoints import GPT2_TOKENIZER
from tests.oracle import assert_same_tokens

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
    "Hello",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
]


@pytest.fixture(scope="module")
def draft_dir(gpt2_model_dir, tmp_path_factory):
    """The target with every weight perturbed: a draft that agrees often, not always."""
    path = tmp_path_factory.mktemp("draft")
    for item in gpt2_model_dir.iterdir():
        shutil.copy(item, path / item.name)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    save_file(
        {k: v + 0.03 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
        path / "model.safetensors",
    )
    return path


@pytest.fixture(scope="module")
def reference(gpt2_model_dir):
    """Non-speculative greedy tokens and the logits along them (for mismatch reports)."""
    llm = LLM(str(gpt2_model_dir), max_model_len=512, num_blocks=128)
    outputs = llm.generate(PROMPTS, GREEDY)
    results = []
    for output in outputs:
        tokens = output.outputs[0].token_ids
        logits = llm.engine.score(output.prompt_token_ids + tokens)[
            len(output.prompt_token_ids) - 1 :
        ]
        results.append((tokens, logits))
    return results


def speculative_llm(model_dir, draft_dir=None, **options) -> LLM:
    spec = dict(speculative_model=str(draft_dir)) if draft_dir else dict(speculative_method="ngram")
    return LLM(str(model_dir), max_model_len=512, num_speculative_tokens=4, **spec, **options)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("num_blocks", [128, 12])
def test_greedy_speculation_is_exact(gpt2_model_dir, draft_dir, reference, proposer, num_blocks):
    llm = speculative_llm(
        gpt2_model_dir,
        draft_dir if proposer == "draft" else None,
        num_blocks=num_blocks,
        max_num_batched_tokens=64,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    for i, (output, (tokens, logits)) in enumerate(zip(outputs, reference, strict=True)):
        assert_same_tokens(output.outputs[0].token_ids, tokens, logits, f"{proposer} request {i}")
    stats = llm.engine.runner.spec_stats
    assert 0 < stats.num_accepted < stats.num_proposed, "both acceptance and rejection must occur"
    assert sum(o.outputs[0].num_spec_proposed for o in outputs) == stats.num_proposed
    # every verifying step emits its accepted prefix plus one token, and stops at most once
    assert stats.num_emitted == stats.num_accepted + stats.num_verify_steps
    assert 0 < stats.num_rejections <= stats.num_verify_steps
    assert stats.num_accepted + stats.num_rejections <= stats.num_proposed
    assert stats.draft_time_s > 0, "proposing is timed for both proposers"
    if num_blocks == 12:
        assert llm.engine.scheduler.stats.num_preemptions > 0, (
            "the small cache must force preemption"
        )
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == num_blocks


def test_speculation_mixes_with_ordinary_requests_and_prefix_cache(
    gpt2_model_dir, draft_dir, reference
):
    llm = speculative_llm(gpt2_model_dir, draft_dir, num_blocks=128)
    plain = GREEDY.with_updates(speculate=False)
    params = [GREEDY, plain, GREEDY, plain]
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)  # prefix-cache hits this time
    for run in (first, again):
        for output, (tokens, logits), p in zip(run, reference, params, strict=True):
            assert_same_tokens(output.outputs[0].token_ids, tokens, logits, "mixed batch")
            assert (output.outputs[0].num_spec_proposed > 0) == p.speculate
    assert any(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.num_free_blocks() == 128


def test_skipping_the_rollback_is_caught(gpt2_model_dir, draft_dir, reference, monkeypatch):
    """A test of the test: keep rejected proposals' cache entries as if computed, and the equality check
    must fail (wrong tokens, or a request that never finishes)."""
    monkeypatch.setattr(Scheduler, "_discard_rejected", lambda self, request, num_rejected: None)
    llm = speculative_llm(gpt2_model_dir, draft_dir, num_blocks=128)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), llm.encode(prompt), GREEDY)
    finished = {}
    for _ in range(400):  # a bounded run: the bug may leave requests stuck
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    got = [finished.get(i) for i in range(len(PROMPTS))]
    with pytest.raises(AssertionError):
        for tokens, (expected, logits) in zip(got, reference, strict=True):
            assert tokens is not None, "a request never finished"
            assert_same_tokens(tokens, expected, logits, "without rollback")


def test_stochastic_verification_preserves_the_target_distribution(checkpoints):
    """200,000 vectorised accept/resample trials on one conditional distribution: target p and draft q
    from two different checkpoints, at temperature 0.9 with top-k 50 applied to both."""
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7, 120, 64]])
    with torch.no_grad():
        p_logits = checkpoints["llama"][1](prompt).logits[0, -1]
        q_logits = checkpoints["llama_tied"][1](prompt).logits[0, -1]

    def process(logits):
        logits = logits / 0.9
        kth = logits.topk(50).values[-1]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1).double()

    p, q = process(p_logits), process(q_logits)
    tv_pq = 0.5 * (p - q).abs().sum().item()
    gen = torch.Generator().manual_seed(0)
    num, chunk = 200_000, 50_000
    counts = torch.zeros_like(p)
    accepted = 0
    for _ in range(num // chunk):
        proposals = torch.multinomial(q, chunk, replacement=True, generator=gen).unsqueeze(1)
        uniforms = torch.rand(chunk, 1, generator=gen, dtype=torch.float64)
        p_rows = torch.stack([p, p]).unsqueeze(0).expand(chunk, 2, -1)
        q_rows = q.view(1, 1, -1).expand(chunk, 1, -1)
        num_accepted, final = verify_stochastic(
            p_rows, q_rows, proposals, uniforms, [None] * chunk, gen
        )
        # the emitted token: the accepted proposal, else the residual sample
        emitted = torch.where(num_accepted == 1, proposals[:, 0], final)
        counts += torch.bincount(emitted, minlength=p.numel()).double()
        accepted += int(num_accepted.sum())
    empirical = counts / num
    tv = 0.5 * (empirical - p).abs().sum().item()
    # E|p̂_i - p_i| <= sqrt(p_i (1 - p_i) / n), and TV moves by at most 1/n per trial, so by McDiarmid
    # P(TV > E[TV] + t) <= exp(-2 n t^2): t = 0.006 gives exp(-14.4).
    bound = 0.5 * torch.sqrt(p * (1 - p) / num).sum().item() + 0.006
    assert tv_pq > 0.3, "the two checkpoints should disagree clearly"
    assert tv < bound < tv_pq / 10, (tv, bound, tv_pq)
    alpha = torch.minimum(p, q).sum().item()
    rate = accepted / num
    assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / num), (rate, alpha)


def test_greedy_verification_by_hand():
    argmax = torch.tensor([[4, 5, 6, 7], [4, 9, 6, 7], [1, 2, 3, 4]])
    proposals = torch.tensor([[4, 5, 6], [4, 5, 6], [9, 9, 9]])
    num_accepted, final = verify_greedy(argmax, proposals)
    assert num_accepted.tolist() == [3, 1, 0]
    assert final.tolist() == [7, 9, 1]  # bonus, correction, correction


def test_ngram_lookup():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert proposer.propose([7, 8, 9, 10], 2) == []
    assert proposer.propose([5, 6, 5, 6, 5], 4) == [6, 5, 6, 5]  # a period continues
    assert proposer.propose([1, 256, 3, 1, 256], 2) == [3, 1]  # token ids wider than a byte


def test_draft_with_a_different_vocabulary_is_refused(gpt2_model_dir, draft_dir, tmp_path):
    for item in draft_dir.iterdir():
        shutil.copy(item, tmp_path / item.name)
    tokenizer = json.loads((GPT2_TOKENIZER / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]  # same size, two ids swapped
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match="maps ids to tokens differently.*2 tokens differ"):
        speculative_llm(gpt2_model_dir, tmp_path, num_blocks=16)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_stochastic_speculation_runs_in_the_engine(gpt2_model_dir, draft_dir, proposer):
    llm = speculative_llm(gpt2_model_dir, draft_dir if proposer == "draft" else None, num_blocks=64)
    params = SamplingParams(
        max_tokens=30, temperature=0.3, top_p=0.9, seed=3, ignore_eos=True, logprobs=2
    )
    if proposer == "ngram":
        # Random-weight text at a temperature rarely repeats, so n-gram lookup would find nothing to
        # propose. top_k=2 keeps sampling (and stochastic verification) but makes the text loop.
        params = params.with_updates(top_k=2, top_p=1.0)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    for a, b in zip(first, again, strict=True):
        completion = a.outputs[0]
        assert len(completion.token_ids) == 30 and completion.finish_reason == "length"
        assert completion.token_ids == b.outputs[0].token_ids  # same seed, same output
        assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    stats = llm.engine.runner.spec_stats
    assert stats.num_proposed > 0
    if proposer == "draft":  # random text rarely repeats, so n-gram proposals are rarely accepted
        assert stats.num_accepted > 0
    # unseeded: rejection sampling against the draft's q (a seeded request takes the coupled path)
    before = (stats.num_proposed, stats.num_accepted)
    for out in llm.generate(PROMPTS, params.with_updates(seed=None)):
        completion = out.outputs[0]
        assert len(completion.token_ids) == 30
        assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    assert stats.num_proposed > before[0]
    if proposer == "draft":
        assert stats.num_accepted > before[1]
    assert llm.engine.num_free_blocks() == 64


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("options", [{}, {"num_blocks": 12}, {"max_num_batched_tokens": 6}])
def test_a_seeded_request_gives_the_non_speculative_output(
    gpt2_model_dir, draft_dir, proposer, options
):
    """Differential fuzzing: with speculation a seeded request's tokens depended on its neighbours
    (preemption dropped proposals after their draws were taken; the step budget cut how many were
    verified, so how many uniforms each step took). Now each position's token is the target's draw
    with that position's uniform: the output is the non-speculative one, alone or in a batch, with
    preemption (12 blocks) or a budget of 6 tokens a step."""
    params = [
        SamplingParams(max_tokens=24, temperature=1.0, top_k=k, seed=11 + i, ignore_eos=True)
        for i, k in enumerate((50, 2, 0, 3))
    ]  # top_k 2 and 3 make the text loop, so n-gram lookup has proposals
    plain = LLM(str(gpt2_model_dir), max_model_len=512, num_blocks=64)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    llm = speculative_llm(gpt2_model_dir, draft_dir if proposer == "draft" else None, **options)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    alone = [
        llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, params, strict=True)
    ]
    assert together == want and alone == want
    stats = llm.engine.runner.spec_stats
    assert stats.num_accepted > 0  # the coupled draws do agree with the proposals at times
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


@pytest.mark.slow
def test_server_reports_speculation(gpt2_model_dir, draft_dir):
    import httpx

    from tests.server_utils import running_server

    args = ("--speculative-model", str(draft_dir), "--num-speculative-tokens", "3",
            "--max-model-len", "512", "--kv-cache-memory", "32MiB")  # fmt: skip
    with running_server(gpt2_model_dir, *args) as (url, _):
        body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        metrics = response["metrics"]
        assert metrics["num_spec_proposed"] > 0 and 0 <= metrics["num_spec_accepted"]
        text = httpx.get(f"{url}/metrics").text
        assert (
            f"kvserve_spec_decode_num_draft_tokens_total {metrics['num_spec_proposed']}.0" in text
        )
        assert (
            f"kvserve_spec_decode_num_accepted_tokens_total {metrics['num_spec_accepted']}.0"
            in text
        )


def test_lookahead_counts_against_the_cache_limit(gpt2_model_dir):
    """A request that fills the cache exactly would never fit with the proposer's lookahead slots: it is
    refused up front instead of waiting forever."""
    from kvserve.core.errors import CapacityError

    llm = speculative_llm(gpt2_model_dir, None, num_blocks=4, block_size=16)  # 64 slots, gamma 4
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with pytest.raises(CapacityError, match=r"\(\+ 4 lookahead\) need 5 KV blocks"):
        llm.generate([[1, 2, 3, 4]], params)
    fits = llm.generate([[1, 2, 3, 4]], params.with_updates(speculate=False))[0]
    assert len(fits.outputs[0].token_ids) == 60


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 10}])
def test_a_grammar_ends_the_output_where_it_terminates(gpt2_model_dir, draft_dir, proposer, extra):
    """fuzzing: with a draft model, ignore_eos (or min_tokens) and a choice, the output went on past
    the grammar's stop token ("yes" came back "yes\\n"): a verification step emits its accepted
    proposals and one more token, unmasked once the grammar has ended, and the stop token did not
    end the request. The output is now the non-speculative one, token for token."""
    from kvserve.core.sampling_params import StructuredOutput

    choices = ["yes", "no", "maybe"]
    structured = StructuredOutput("choice", json.dumps(choices))
    params = SamplingParams(max_tokens=20, temperature=0, structured=structured, **extra)
    prompts = ["hi", "Hello", "The answer is", "Q: yes or no?", PROMPTS[0]]
    plain = LLM(str(gpt2_model_dir), max_model_len=512).generate(prompts, params)
    llm = speculative_llm(gpt2_model_dir, draft_dir if proposer == "draft" else None)
    for got, want in zip(llm.generate(prompts, params), plain, strict=True):
        assert got.outputs[0].text in choices, got.outputs[0].text
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_a_stop_string_ends_the_output_at_the_token_completing_it(
    gpt2_model_dir, draft_dir, proposer
):
    """fuzzing: a verification step commits several tokens; those after the one completing a stop
    string stayed in token_ids and logprobs (the text was right). The output is now the
    non-speculative one, token for token."""
    plain_llm = LLM(str(gpt2_model_dir), max_model_len=512)
    llm = speculative_llm(gpt2_model_dir, draft_dir if proposer == "draft" else None)
    texts = [o.outputs[0].text for o in plain_llm.generate(PROMPTS, GREEDY)]
    cases = [
        (p, t[i : i + 2]) for p, t in zip(PROMPTS, texts, strict=True) for i in (3, 11, 24, 37)
    ]
    params = [GREEDY.with_updates(stop=(stop,), logprobs=1) for _, stop in cases]
    prompts = [p for p, _ in cases]
    for got, want in zip(
        llm.generate(prompts, params), plain_llm.generate(prompts, params), strict=True
    ):
        g, w = got.outputs[0], want.outputs[0]
        assert (g.text, g.finish_reason, g.stop_reason) == (w.text, "stop", w.stop_reason)
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks
