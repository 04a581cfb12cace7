"""Tensor parallelism through the engine (kvserve/runner/executor.py, docs/parallel.md): `LLM(...,
tensor_parallel_size=2)` on CPU, rank 0 in this process and rank 1 a gloo worker process, against
the same engine at one rank.

Oracle: the TP=1 engine with the same options. Greedy tokens must be equal and fp32 logits (scored
through the paged cache along the generated tokens) within ATOL: the sharded matmuls and the
all-reduce add the same products in another order. The process group is one per process, so every
test starts its TP=2 engine and shuts it down before the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.errors import ModelLoadError
from kvserve.core.sampling_params import StructuredOutput
from kvserve.model.loader import read_checkpoint
from kvserve.quant.scheme import QuantizationError
from kvserve.runner.executor import WorkerFailedError
from tests.checkpoints import ARCHS
from tests.oracle import assert_logits_close, assert_same_tokens

ATOL = 2e-5  # fp32 logits; measured at most 2.3e-6 (logits up to 3.4) on these checkpoints
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [
    [5, 17, 99, 3, 42, 7, 7, 120, 64, 33, 250, 11, 9, 1, 77, 200, 18, 30],
    [8, 6, 201, 45, 3, 19],
    [100, 101, 102],
]
OPTIONS = dict(block_size=4, num_blocks=64, max_model_len=128)


@contextlib.contextmanager
def tp_llm(model_dir, **options):
    llm = LLM(str(model_dir), tensor_parallel_size=2, **options)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_equal_runs(tp, ref, prompts, params, what: str) -> None:
    """TP=2 and TP=1 give the same greedy tokens, and logits along them within ATOL."""
    got, want = tp.generate(prompts, params), ref.generate(prompts, params)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        ids = w.prompt_token_ids + w.outputs[0].token_ids
        ref_logits = ref.engine.score(ids)
        num_prompt = len(w.prompt_token_ids)
        assert_same_tokens(
            g.outputs[0].token_ids, w.outputs[0].token_ids, ref_logits[num_prompt - 1 :], what
        )
        assert_logits_close(tp.engine.score(ids), ref_logits, ATOL, f"{what} request {i}")


def _replicated(name: str) -> bool:
    return "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias"))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tp2_equals_tp1_and_holds_half_per_rank(checkpoints, arch):
    model_dir = checkpoints[arch][0]
    ref = LLM(str(model_dir), **OPTIONS)
    with tp_llm(model_dir, **OPTIONS) as tp:
        assert_equal_runs(tp, ref, PROMPTS, GREEDY, arch)
        runner = tp.engine.runner
        # KV cache bytes per rank, measured from each rank's allocated tensors: 2 KV heads over 2
        # ranks, the same number of blocks
        assert runner.rank_kv_cache_bytes == [ref.engine.runner.kv_cache_bytes // 2] * 2
        # weights per rank, measured from each rank's loaded tensors: half of every split tensor
        # (vocabulary 256, even heads and FFN width) plus every replicated norm whole
        whole = read_checkpoint(model_dir)
        if tp.engine.config.model.tie_word_embeddings:
            whole.pop("lm_head.weight", None)
        split = sum(t.nbytes for n, t in whole.items() if not _replicated(n))
        replicated = sum(t.nbytes for n, t in whole.items() if _replicated(n))
        assert runner.rank_weight_bytes == [split // 2 + replicated] * 2
        tp.engine.check_invariants()
        assert tp.engine.num_free_blocks() == OPTIONS["num_blocks"]


def test_prefix_caching_chunked_prefill_and_preemption_unchanged(checkpoints):
    """A small token budget chunks the long prompts, a small cache preempts, the second call hits
    the prefix cache: the same tokens and logits as one rank under the same options."""
    model_dir = checkpoints["llama"][0]
    options = dict(block_size=4, num_blocks=14, max_model_len=128, max_num_batched_tokens=8)
    shared = PROMPTS[0][:16]
    second = [shared + [3, 4], shared + [9], PROMPTS[1] * 2, PROMPTS[2]]
    params = GREEDY.with_updates(max_tokens=20)
    ref = LLM(str(model_dir), **options)
    with tp_llm(model_dir, **options) as tp:
        assert_equal_runs(tp, ref, [PROMPTS[0]], params, "first call")
        outputs = tp.generate(second, params)
        assert tokens_of(outputs) == tokens_of(ref.generate(second, params))
        assert any(o.num_cached_tokens > 0 for o in outputs), "the prefix cache must hit"
        assert tp.engine.scheduler.stats.num_preemptions > 0, "the small cache must preempt"
        tp.engine.check_invariants()
        assert tp.engine.num_free_blocks() == options["num_blocks"]


@pytest.fixture(scope="module")
def draft_dir(gpt2_model_dir, tmp_path_factory):
    """The target with every weight perturbed: a draft that agrees often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

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


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_speculative_decoding_unchanged(gpt2_model_dir, draft_dir, proposer):
    """The draft runs whole on rank 0; the target's verification forwards run on both ranks. The
    gpt2-tokenised checkpoint has one KV head: replicated on both ranks (whole KV per rank)."""
    spec = (
        dict(speculative_model=str(draft_dir))
        if proposer == "draft"
        else dict(speculative_method="ngram")
    )
    options = dict(max_model_len=256, num_blocks=64, num_speculative_tokens=4)
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "Hello"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(str(gpt2_model_dir), **options)  # no speculation: the target's greedy tokens
    with tp_llm(gpt2_model_dir, **options, **spec) as tp:
        outputs = tp.generate(prompts, params)
        assert tokens_of(outputs) == tokens_of(plain.generate(prompts, params))
        stats = tp.engine.runner.spec_stats
        assert 0 < stats.num_accepted < stats.num_proposed, "both acceptance and rejection"
        # the target's KV per rank, measured: the one KV head is whole on both ranks
        assert tp.engine.runner.rank_kv_cache_bytes == [plain.engine.runner.kv_cache_bytes] * 2
        # structured output (masks on rank 0) and seeded sampling (rank 0 samples; not speculated:
        # stochastic verification keeps the distribution, not the draws) as at one rank
        schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}, "required": ["a"]}
        structured = StructuredOutput("json_schema", json.dumps(schema))
        mixed = [
            SamplingParams(max_tokens=32, temperature=0, structured=structured),
            SamplingParams(
                max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, speculate=False
            ),
        ]
        got = tp.generate(["Output:", "Hello"], mixed)
        assert tokens_of(got) == tokens_of(plain.generate(["Output:", "Hello"], mixed))
        assert got[0].outputs[0].structured_complete


def test_int8_weights_shard_with_their_scales(checkpoints):
    """int8 per channel: column-parallel rows quantise alone, row-parallel columns keep their
    whole row's scale, so TP=2 multiplies the same codes and scales as TP=1."""
    model_dir = checkpoints["llama"][0]
    options = dict(OPTIONS, quantization="int8")
    ref = LLM(str(model_dir), **options)
    with tp_llm(model_dir, **options) as tp:
        assert_equal_runs(tp, ref, PROMPTS, GREEDY, "int8")


@pytest.mark.parametrize(
    "scheme, reason",
    [
        ("w8a8", "activations rounded per token"),
        ("int4-pt", "one scale per tensor"),
        ("linear=int8,embed=int8", "quantised embedding"),
        ("int4-g64", "not a multiple of the group size"),  # o_proj: 32 columns per rank
    ],
)
def test_formats_that_cannot_shard_are_refused_before_starting(checkpoints, scheme, reason):
    with pytest.raises(QuantizationError, match=reason):
        LLM(str(checkpoints["llama"][0]), tensor_parallel_size=2, quantization=scheme, **OPTIONS)


def test_bad_layout_is_refused_before_starting(checkpoints):
    with pytest.raises(ModelLoadError, match="attention heads"):  # 4 heads over 3 ranks
        LLM(str(checkpoints["llama"][0]), tensor_parallel_size=3, **OPTIONS)


def test_a_dead_worker_fails_the_engine_loudly(checkpoints):
    """Killing rank 1 makes the next step raise (no hang), and every step after it; shutdown still
    works and a new tensor-parallel engine can start in this process."""
    model_dir = checkpoints["llama"][0]
    with tp_llm(model_dir, **OPTIONS) as tp:
        tp.generate(PROMPTS[:1], GREEDY)
        worker = tp.engine.runner._workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1"):
            tp.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 30  # far below the collective timeout: not a hang
        with pytest.raises(WorkerFailedError):
            tp.generate(PROMPTS[:1], GREEDY)
        assert tp.engine.num_free_blocks() == OPTIONS["num_blocks"]  # aborted, blocks returned
    with tp_llm(model_dir, **OPTIONS) as again:
        assert again.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
        store = again.engine.runner._rank0.init_method
    # the ranks met through a file store (no port picked), whose directory shutdown removed
    assert store.startswith("file://")
    assert not os.path.exists(os.path.dirname(store.removeprefix("file://")))


def _engine_in_daemon(model_dir: str, queue) -> None:
    with tp_llm(model_dir, **OPTIONS) as tp:
        queue.put(tokens_of(tp.generate(PROMPTS[:1], GREEDY)))


def test_an_engine_in_a_daemonic_process_starts_its_workers(checkpoints):
    """An engine core process started with daemon=True (as the multi-process server starts it)
    may still start its tensor-parallel workers."""
    import multiprocessing

    model_dir = checkpoints["llama"][0]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_engine_in_daemon, args=(str(model_dir), queue), daemon=True)
    process.start()
    try:
        tokens = queue.get(timeout=120)
    finally:
        process.join(30)
    assert process.exitcode == 0
    assert tokens == tokens_of(LLM(str(model_dir), **OPTIONS).generate(PROMPTS[:1], GREEDY))


def test_cli_flag_reaches_the_config():
    import argparse

    from kvserve.engine.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2"])
    assert EngineArgs.from_cli_args(args).options()["tensor_parallel_size"] == 2
