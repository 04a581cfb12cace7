"""`kvserve check batch-invariance`: the comparison's arithmetic on known traces, and a test of the
test: a batch-dependent perturbation injected into the forward is found (and only where it acts)."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.lab.check.invariance import Position, Trace, compare
from kvserve.lab.check.shapes import CheckConfig, OfflineCheck

PROMPTS = [[(i * 31 + j * 7 + 3) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
CFG = CheckConfig(max_tokens=8, num_logprobs=5, batch_sizes=(2, 4), chunk_tokens=8,
                  long_neighbour_tokens=40)  # fmt: skip


def pos(token, logprobs: dict) -> Position:
    return Position(token, logprobs[token], logprobs)


def test_compare_reports_first_difference_max_diff_and_gaps():
    ref = Trace((pos(1, {1: -0.1, 2: -2.0}), pos(3, {3: -0.5, 4: -0.7}), pos(5, {5: -0.2, 6: -3})))
    same = compare(ref, ref)
    assert same.tokens_equal and same.max_abs_logprob_diff == 0.0
    assert same.min_gap_argmax_held == pytest.approx(0.2)  # position 1: -0.5 vs -0.7
    var = Trace((pos(1, {1: -0.15, 2: -1.9}), pos(4, {4: -0.55, 3: -0.6}), pos(9, {9: -0.1})))
    c = compare(ref, var)
    assert c.first_differing_position == 1
    assert c.gap_at_divergence == pytest.approx(0.2)  # a near-tie flipped
    assert c.min_gap_argmax_held == pytest.approx(1.9)  # only position 0 held
    # compared up to and including position 1: |-0.6 - -0.5| = 0.1 (token 3), 0.15 (token 4)
    assert c.max_abs_logprob_diff == pytest.approx(0.15) and c.max_diff_position == 1


def run_check(make_llm):
    return OfflineCheck(make_llm, PROMPTS, CFG).run()


@pytest.fixture(scope="module")
def make_llm(llama_dir):
    from kvserve import LLM

    return lambda **options: LLM(str(llama_dir), dtype="float32", **options)


def perturb(monkeypatch, delta: float):
    """Add delta x (number of chunks in the step - 1) x a fixed random vector to every logit row:
    alone, a request's logits are exact; beside others, they move."""
    import kvserve.runner.model_runner as model_runner

    real = model_runner.forward_chunks
    direction = torch.randn(256, generator=torch.Generator().manual_seed(0))  # [vocab]

    def perturbed(model, kv_caches, attention, chunks, *args, **kwargs):
        logits = real(model, kv_caches, attention, chunks, *args, **kwargs)  # [rows, vocab]
        return logits + delta * (len(chunks) - 1) * direction[: logits.shape[-1]]

    monkeypatch.setattr(model_runner, "forward_chunks", perturbed)


BATCHED = {"batch-2", "batch-4", "long-neighbours", "chunked-batch", "spec-batch"}
SINGLE = {"repeat", "chunked-alone", "prefix-cache-hit", "spec-alone"}


def test_the_engine_is_batch_invariant_on_greedy_tokens(make_llm):
    refs, results = run_check(make_llm)
    by_name = {r.name: r for r in results}
    assert set(by_name) == BATCHED | SINGLE
    assert all(r.num_diverged == 0 for r in results), [r.to_json() for r in results]
    assert by_name["repeat"].max_abs_logprob_diff == 0.0
    assert by_name["prefix-cache-hit"].facts["num_prompts_hit"] == len(PROMPTS)
    assert all(len(t.positions) == CFG.max_tokens for t in refs)


def test_a_small_injected_perturbation_shows_in_the_logprobs_of_batched_shapes_only(
    make_llm, monkeypatch
):
    perturb(monkeypatch, 0.02)
    _, results = run_check(make_llm)
    for r in results:
        if r.name in SINGLE:
            assert r.max_abs_logprob_diff < 1e-4, r.name
        else:
            assert r.max_abs_logprob_diff > 5e-3, r.name


def test_a_large_injected_perturbation_changes_tokens_and_is_located(make_llm, monkeypatch):
    perturb(monkeypatch, 50.0)
    _, results = run_check(make_llm)
    by_name = {r.name: r for r in results}
    for name in SINGLE:
        assert by_name[name].num_diverged == 0, name
    for name in ("batch-2", "batch-4", "long-neighbours", "chunked-batch"):
        r = by_name[name]
        assert r.num_diverged > 0 and r.earliest_divergence == 0, name
        # the solo run's gap where the token flipped: a real difference, not a near-tie
        gaps = [c.gap_at_divergence for _, c in r.comparisons if c.gap_at_divergence is not None]
        assert gaps


def test_cli_writes_the_report_and_a_one_screen_summary(llama_dir, tmp_path, capsys):
    from kvserve.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "report.json"
    args = ["check", "batch-invariance", str(llama_dir), "--prompts", str(prompts)]
    args += ["--max-tokens", "4", "--batch-sizes", "2", "--output", str(out)]
    assert main(args) == 0
    summary = capsys.readouterr().out
    assert "batch-invariant" in summary and "prefix-cache-hit" in summary
    assert len(summary.splitlines()) < 25
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 2 and report["invariant"] is True
    assert main(["check", "batch-invariance", str(llama_dir), "--prompts", "/nonexistent"]) == 2
    assert "cannot read --prompts" in capsys.readouterr().err


def test_cli_checks_the_quantised_engine_it_is_given(llama_dir, tmp_path, capsys):
    """`--quantization` builds every shape's engine with it: bf16 products keep the engine's
    batch invariance (one kernel, one summation order at every row count)."""
    from kvserve.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "report.json"
    args = ["check", "batch-invariance", str(llama_dir), "--prompts", str(prompts)]
    args += ["--max-tokens", "4", "--batch-sizes", "2", "--output", str(out)]
    assert main(args + ["--quantization", "linear=bf16,head=bf16"]) == 0
    assert "linear=bf16,head=bf16" in capsys.readouterr().out.splitlines()[0]
    report = json.loads(out.read_text())
    assert report["target"]["quantization"] == "linear=bf16,head=bf16"
    assert report["invariant"] is True
    assert main(args + ["--quantization", "int9"]) == 2  # the engine's own refusal
    assert "int9" in capsys.readouterr().err
    endpoint = ["check", "batch-invariance", "--endpoint", "http://127.0.0.1:9", "--quantization"]
    assert main(endpoint + ["int8"]) == 2
    assert "the server's" in capsys.readouterr().err


def test_endpoint_check_on_a_live_server(gpt2_model_dir, tmp_path, capsys):
    from kvserve.cli import main
    from tests.server_utils import running_server

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there, my friend\ndef add(a, b):\nThe sky is\n")
    out = tmp_path / "report.json"
    with running_server(gpt2_model_dir, "--max-model-len", "256") as (base_url, _):
        args = ["check", "batch-invariance", "--endpoint", base_url, "--prompts", str(prompts)]
        assert main(args + ["--max-tokens", "6", "--batch-sizes", "3", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [s["name"] for s in report["shapes"]]
    assert names == ["repeat", "batch-3", "long-neighbours", "prefix-cache-hit"]
    assert report["target"]["kind"] == "endpoint" and report["invariant"] is True
    assert all(s["prompts"][0]["num_positions"] == 6 for s in report["shapes"])
    assert "batch-invariant" in capsys.readouterr().out
