"""--gguf-activations int8x2 on a tiny GGUF model (Q4_1 matrices, a Q8_0 table and tied head, as
SmolLM2's file): the panel kernel with each activation block rounded twice (the value, then its
remainder; kvserve/model/csrc/qgemv.c ACT_BLOCK2). Its logits sit within 1e-4 of the exact path's
(the file's blocks times fp32 activations) on Q4_0 and Q8_0 files and far closer than int8's; the
fused, pooled, forked and per-op decode steps give the same bits, and a prompt gives the same bits
alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.gguf.model_dir import gguf_model_dir
from tests.checkpoints import build_checkpoint
from tests.gguf_files import write_llama_gguf

PROMPT = [(i * 37 + 11) % 300 + 3 for i in range(40)]
OPTIONS = {"max_model_len": 128, "kv_cache_memory_bytes": 16 << 20}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("int8x2") / "hf", "llama", vocab_size=320,
                            rope_scaling=None)  # fmt: skip


@pytest.fixture(scope="module")
def q4_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("int8x2-q4_1") / "q4.gguf"
    return gguf_model_dir(write_llama_gguf(path, hf_model, "Q4_1", "Q8_0"))


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0"])
def test_int8x2_logits_are_within_fp32_noise_of_the_exact_path(hf_model, tmp_path, ggml_type):
    """Types whose blocks the panel format holds exactly (Q4_1's fp16 zero-point is a rounding of the
    file's min: test_gguf_loading.py bounds it and runs Q4_1 against its transcoded weights)."""
    from kvserve.engine.llm import LLM
    from kvserve.model.qlinear import QuantLinear

    model_dir = gguf_model_dir(write_llama_gguf(tmp_path / "m.gguf", hf_model, ggml_type, "Q8_0"))

    def scores(mode: str) -> torch.Tensor:
        llm = LLM(str(model_dir), gguf_activations=mode, **OPTIONS)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
        modes = {"fp32": [], "int8": [0] * 9, "int8x2": [3] * 9}  # 4 linears x 2 layers, the head
        assert [m.act_mode for m in linears] == modes[mode]
        return llm.engine.score(PROMPT).double()

    exact, twice, once = scores("fp32"), scores("int8x2"), scores("int8")
    error_twice = (twice - exact).abs().max().item()
    error_once = (once - exact).abs().max().item()
    assert error_twice <= 1e-4 * exact.abs().max().item(), error_twice
    assert error_twice * 20 <= error_once, (error_twice, error_once)


def test_int8x2_decode_steps_give_the_same_bits_on_every_route(q4_dir):
    """One token a step on 2 threads: the pooled step (rounding per thread, two rows per input row in
    its buffers), the step that forks per linear, and the per-op path (each linear through
    q_linear_x) give the same logits, bit for bit."""
    from kvserve.engine.llm import LLM
    from kvserve.model import fused_decode

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(q4_dir), gguf_activations="int8x2", thread_policy="fixed", **OPTIONS)
        model = llm.engine.runner.model
        before = fused_decode.pooled_steps()
        pooled = llm.engine.score(PROMPT, chunk_size=1)
        assert model.fused is not None and fused_decode.pooled_steps() - before == len(PROMPT)
        fused_decode.set_pooled_step(False)
        try:
            forked = llm.engine.score(PROMPT, chunk_size=1)
        finally:
            fused_decode.set_pooled_step(True)
        model.fused_decode, model.fused = False, None
        per_op = llm.engine.score(PROMPT, chunk_size=1)
        assert torch.equal(pooled, forked) and torch.equal(pooled, per_op)
    finally:
        torch.set_num_threads(threads)


def test_int8x2_gives_a_prompt_the_same_tokens_and_logprobs_alone_and_batched(q4_dir):
    from kvserve.engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = [PROMPT[i:] for i in range(0, 24, 3)]
    llm = LLM(str(q4_dir), gguf_activations="int8x2", enable_prefix_caching=False, **OPTIONS)
    alone = [llm.generate([p], params)[0].outputs[0] for p in prompts]
    batched = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(alone, batched, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        assert [(x.token_id, x.logprob) for x in a.logprobs] == [
            (x.token_id, x.logprob) for x in b.logprobs
        ]


def test_the_batch_invariance_check_runs_the_engine_in_the_products_it_is_given(
    q4_dir, tmp_path, capsys
):
    """`kvserve check batch-invariance --gguf-activations int8x2` builds every shape's engine with
    those products (the report says so), and on a file whose every matrix runs on the panel kernel
    every shape gives the solo run's tokens; with --endpoint the server's own products run, so the
    option is refused there."""
    import json

    from kvserve.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": PROMPT[:12]}) + "\n"
                       + json.dumps({"prompt_token_ids": PROMPT[5:30]}) + "\n")  # fmt: skip
    out = tmp_path / "report.json"
    args = ["check", "batch-invariance", str(q4_dir), "--prompts", str(prompts)]
    args += ["--max-tokens", "4", "--batch-sizes", "2", "--max-model-len", "128"]
    args += ["--output", str(out)]
    assert main(args + ["--gguf-activations", "int8x2"]) == 0
    report = json.loads(out.read_text())
    assert report["target"]["gguf_activations"] == "int8x2"
    assert report["invariant"] is True
    capsys.readouterr()
    endpoint = ["check", "batch-invariance", "--endpoint", "http://127.0.0.1:9"]
    assert main(endpoint + ["--gguf-activations", "int8"]) == 2
    assert "the server's" in capsys.readouterr().err


def test_rounding_activations_beside_the_fp32_block_kernel_warns_at_load(
    hf_model, q4_dir, tmp_path, caplog
):
    """A file with matrices that have no integer panel format (Q5_1 here, the K-quants in Gemma 3)
    keeps them on the fp32 block kernel under --gguf-activations int8 / int8x2; that mix makes
    outputs depend on batching (docs/determinism.md), so loading says so, naming the types. A file
    the panel kernel runs whole, or the exact path, loads without it."""
    import logging

    from kvserve import LLM

    mixed = gguf_model_dir(write_llama_gguf(tmp_path / "q5_1.gguf", hf_model, "Q5_1", "Q8_0"))
    loads = [(mixed, "int8", True), (mixed, "int8x2", True), (mixed, "fp32", False),
             (q4_dir, "int8x2", False)]  # fmt: skip
    for model_dir, mode, warns in loads:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvserve.model.loader"):
            LLM(str(model_dir), gguf_activations=mode, **OPTIONS)
        said = [
            r.getMessage() for r in caplog.records if "no integer panel format" in r.getMessage()
        ]
        assert bool(said) == warns, (mode, said)
        if warns:
            assert said[0].startswith(f"--gguf-activations {mode}: the Q5_1 matrices")
