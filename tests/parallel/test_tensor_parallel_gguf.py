"""A GGUF file under tensor parallelism (kvserve/model/parallel.py `read_float_checkpoint`,
docs/parallel.md): every rank dequantises the file's blocks to fp32 in the Hugging Face layout and
takes its slices, as from a safetensors checkpoint.

The model is SmolLM2-135M's head layout in miniature: 9 query heads and 3 KV heads, which split 3
ways (3 heads and one KV head per rank) and not 2. Oracles: the same file at TP = 1 (its blocks times
fp32 activations) and transformers reading the file (`gguf_file=`, dequantised to fp32). Greedy
tokens must be equal; logits scored along them within ATOL (the same dequantised products, summed
in another order).
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.errors import ModelLoadError
from kvserve.quant.scheme import QuantizationError
from tests.checkpoints import build_checkpoint
from tests.gguf_files import write_llama_gguf
from tests.oracle import assert_logits_close, assert_same_tokens

pytestmark = pytest.mark.slow

ATOL = 1e-4  # as tests/gguf/test_gguf_loading.py: fp32 sums of exactly dequantised weights
MAX_TOKENS = 8
PROMPTS = [[1, 5, 9, 33, 100, 7, 250, 64, 12, 300, 3, 44], [8, 6, 201, 45, 3, 19]]
OPTIONS = dict(block_size=4, num_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-gguf")
    model = build_checkpoint(
        root / "hf",
        "llama_tied",
        vocab_size=320,
        rope_scaling=None,
        hidden_size=288,  # 9 heads of 32; every matrix's input a multiple of Q4_1's 32
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=192,
        num_hidden_layers=2,
    )
    return write_llama_gguf(root / "tiny-Q4_1.gguf", model, "Q4_1", "Q8_0")


def _transformers_greedy(path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' argmax chain from `prompt` and its logits along it."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = ref(torch.tensor([ids])).logits[0]
    return ids[len(prompt) :], logits


def test_tp3_of_a_gguf_file_equals_tp1_and_transformers(gguf_path):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref = LLM(str(gguf_path), gguf_activations="fp32", **OPTIONS)  # what the ranks compute
    want = ref.generate(PROMPTS, params)
    tp = LLM(str(gguf_path), tensor_parallel_size=3, **OPTIONS)
    try:
        got = tp.generate(PROMPTS, params)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            prompt, tokens = w.prompt_token_ids, list(w.outputs[0].token_ids)
            hf_tokens, hf_logits = _transformers_greedy(gguf_path, prompt)
            ids = prompt + tokens
            tp_logits = tp.engine.score(ids)
            rows = slice(len(prompt) - 1, None)
            assert_same_tokens(tokens, hf_tokens, hf_logits[rows], f"TP=1 vs transformers {i}")
            assert_same_tokens(list(g.outputs[0].token_ids), tokens, hf_logits[rows], f"TP=3 {i}")
            assert_logits_close(tp_logits, hf_logits, ATOL, f"TP=3 vs transformers {i}")
            assert_logits_close(tp_logits, ref.engine.score(ids), ATOL, f"TP=3 vs TP=1 {i}")
        # one KV head of the three per rank: a third of TP=1's cache for the same blocks
        runner = tp.engine.runner
        assert runner.rank_kv_cache_bytes == [ref.engine.runner.kv_cache_bytes // 3] * 3
    finally:
        tp.engine.shutdown()


def test_a_size_that_does_not_split_the_heads_names_the_ones_that_do(gguf_path):
    with pytest.raises(ModelLoadError, match=r"9 attention heads.*sizes that work: 1, 3$"):
        LLM(str(gguf_path), tensor_parallel_size=2, **OPTIONS)


@pytest.mark.parametrize("mode", ["int8", "int8x2"])
def test_int8_gguf_activations_are_refused_under_tensor_parallelism(gguf_path, mode):
    with pytest.raises(QuantizationError, match=f"--gguf-activations {mode} .*dequantises them"):
        LLM(str(gguf_path), tensor_parallel_size=3, gguf_activations=mode, **OPTIONS)
