"""Workloads: length distributions, token-exact prompt fitting, seeding, shared prefixes,
ShareGPT."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from kvserve.lab.bench.records import BenchError
from kvserve.lab.bench.text import pieces, take_pieces
from kvserve.lab.bench.tokenization import ApproxTokenizer, LocalTokenizer, PromptFitter
from kvserve.lab.bench.workloads import LengthDist, WorkloadSpec, build_workload
from tests import FIXTURES


class UnevenCounter:
    """A BPE-like stand-in: a word of n letters costs ceil(n / 4) tokens, a punctuation mark one."""

    name, exact = "uneven", True

    def __init__(self) -> None:
        self.calls = 0

    def count(self, text: str) -> int:
        self.calls += 1
        words = re.findall(r"\w+", text)
        return sum(math.ceil(len(w) / 4) for w in words) + len(re.findall(r"[^\w\s]", text))

    def identity(self) -> dict:
        return {"kind": "test"}

    def close(self) -> None:
        pass


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("64").sample(rng) == 64
    assert LengthDist.parse("fixed:8") == LengthDist("fixed", 8)
    uni = LengthDist.parse("uniform:10:20")
    draws = [uni.sample(rng) for _ in range(2000)]
    assert min(draws) == 10 and max(draws) == 20
    logn = LengthDist.parse("lognormal:100:1.0:20:300")
    draws = np.array([logn.sample(rng) for _ in range(4000)])
    assert draws.min() == 20 and draws.max() == 300  # clipped at both ends (sigma 1 reaches both)
    # the median survives clipping: P(X <= 100) = 1/2, SE of a proportion = 0.5 / sqrt(n)
    assert abs(np.mean(draws <= 100) - 0.5) < 5 * 0.5 / math.sqrt(len(draws))
    for bad in ("uniform:5", "lognormal:0:1", "gauss:3", "uniform:9:3", "x"):
        with pytest.raises(BenchError):
            LengthDist.parse(bad)


@pytest.mark.parametrize("content", ["prose", "code"])
def test_fitter_hits_exact_lengths_with_few_counts(content):
    counter = UnevenCounter()
    fitter = PromptFitter(counter)
    targets = [1, 2, 5, 17, 64, 200, 513, 64, 200]
    for i, target in enumerate(targets):
        text, count = fitter.fit(pieces(content, np.random.default_rng(i)), target)
        assert count == target == counter.count(text)
    assert fitter.num_count_calls < 8 * len(targets)  # ~log searches, not a linear scan


def test_fitter_with_a_prefix_and_an_impossible_prefix():
    fitter = PromptFitter(UnevenCounter())
    prefix, n = fitter.fit(pieces("prose", np.random.default_rng(1)), 40)
    text, count = fitter.fit(pieces("prose", np.random.default_rng(2)), 60, prefix=prefix)
    assert text.startswith(prefix) and count == 60 and n == 40
    with pytest.raises(BenchError):
        fitter.fit(pieces("prose", np.random.default_rng(2)), 10, prefix=prefix)


def test_code_is_repetitive_and_prose_is_not():
    code = "".join(take_pieces("code", np.random.default_rng(0), 400))
    prose = "".join(take_pieces("prose", np.random.default_rng(0), 400))
    assert code.count("def ") >= 5 and "return result" in code

    # a crude predictability measure: distinct 3-grams of pieces per piece
    def novelty(text):
        words = text.split()
        return len(set(zip(words, words[1:], words[2:], strict=False))) / len(words)

    assert novelty(code) < 0.5 * novelty(prose)


def test_workloads_are_seeded_per_request_index():
    spec = WorkloadSpec(
        input_len=LengthDist.parse("uniform:5:40"), output_len=LengthDist.parse("9")
    )
    short = build_workload(spec, 5, PromptFitter(UnevenCounter()))
    long = build_workload(spec, 12, PromptFitter(UnevenCounter()))
    assert long[:5] == short  # a longer run starts with exactly the shorter run's requests
    assert len({r.prompt for r in long}) == 12
    assert all(5 <= r.num_prompt_tokens <= 40 and r.max_tokens == 9 for r in long)
    reseeded = WorkloadSpec(seed=1, input_len=spec.input_len, output_len=spec.output_len)
    other = build_workload(reseeded, 5, PromptFitter(UnevenCounter()))
    assert [r.prompt for r in other] != [r.prompt for r in short]
    tail = build_workload(spec, 12, PromptFitter(UnevenCounter()), start=5)
    assert tail == long[5:]
    overridden = build_workload(
        spec, 2, PromptFitter(UnevenCounter()), lengths=[(7, None), (None, 3)]
    )
    assert overridden[0].num_prompt_tokens == 7 and overridden[1].max_tokens == 3


def test_shared_prefix_workload():
    spec = WorkloadSpec(
        kind="shared-prefix",
        input_len=LengthDist.parse("uniform:3:12"),
        output_len=LengthDist.parse("4"),
        prefix_len=30,
        num_prefixes=2,
    )
    reqs = build_workload(spec, 16, PromptFitter(UnevenCounter()))
    groups = {r.group for r in reqs}
    assert groups == {0, 1}
    counter = UnevenCounter()
    for g in groups:
        members = [r.prompt for r in reqs if r.group == g]
        common = members[0]
        for p in members[1:]:
            while not p.startswith(common):
                common = common[:-1]
        assert counter.count(common) >= 29  # the group's prefix (a boundary piece may merge)
    assert all(33 <= r.num_prompt_tokens <= 42 for r in reqs)


def test_sharegpt_workload_filters_and_uses_reference_lengths():
    path = str(FIXTURES / "bench" / "sharegpt_small.json")
    spec = WorkloadSpec(kind="sharegpt", dataset=path, output_len=None, sharegpt_max_prompt_len=30)
    counter = ApproxTokenizer()
    reqs = build_workload(spec, 5, PromptFitter(counter))
    prompts = {r.prompt for r in reqs}
    assert "Hi" not in prompts  # < 4 tokens
    assert not any(p.startswith("Give me three tips") for p in prompts)  # reply < 4 tokens
    assert not any(p.startswith("long long") for p in prompts)  # prompt over the maximum
    assert any(p.startswith("Summarise the plot") for p in prompts)  # the `messages` format
    for r in reqs:
        assert r.num_prompt_tokens == counter.count(r.prompt) and r.max_tokens >= 4
    assert reqs == build_workload(spec, 5, PromptFitter(counter))
    with pytest.raises(BenchError, match="only 5 usable"):
        build_workload(spec, 6, PromptFitter(counter))


def test_real_gpt2_tokenizer_gives_exact_lengths():
    tok = LocalTokenizer(FIXTURES / "gpt2-tokenizer")
    fitter = PromptFitter(tok)
    for content in ("prose", "code"):
        for i, target in enumerate((1, 9, 128, 700)):
            text, count = fitter.fit(pieces(content, np.random.default_rng(i)), target)
            assert count == target == tok.count(text), (content, target)
    assert "tokenizer.json" in tok.identity()["sha256"]
