"""Each bad input gets a typed error with an actionable message; nothing leaks."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.core.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_blocks=16, max_model_len=128)


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        (dict(max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1"),
        (dict(max_tokens=-3), "max_tokens", "max_tokens must be an integer >= 1"),
        (dict(n=0), "n", "n must be an integer >= 1"),
        (dict(min_tokens=-1), "min_tokens", "min_tokens must be an integer >= 0"),
        (dict(min_tokens=9, max_tokens=4), "min_tokens", "must not exceed max_tokens"),
        (dict(temperature=-0.5), "temperature", "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p", r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), "top_p", r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k", "top_k must be an integer >= 1"),
        (dict(min_p=2.0), "min_p", r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty", "must be > 0"),
        (dict(presence_penalty=3.0), "presence_penalty", r"in \[-2, 2\]"),
        (dict(logprobs=50), "logprobs", r"logprobs must be an integer in \[0, 20\]"),
        (dict(logit_bias={5: 500.0}), "logit_bias", r"\[-100, 100\]"),
        (dict(stop=[""]), "stop", "non-empty"),
    ],
)
def test_invalid_sampling_params(kwargs, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], SamplingParams())


def test_unknown_token_ids(llm):
    with pytest.raises(
        InvalidRequestError, match=r"outside the vocabulary \[0, 256\): \[256, -1\]"
    ):
        llm.generate([[1, 2, 256, -1]], SamplingParams())


def test_prompt_plus_max_tokens_beyond_context(llm):
    with pytest.raises(
        ContextLengthError,
        match=r"prompt \(100 tokens\) \+ max_tokens \(50\) = 150 "
        r"exceeds this model's context of 128 tokens",
    ):
        llm.generate([[3] * 100], SamplingParams(max_tokens=50))
    with pytest.raises(ContextLengthError, match="the prompt has 128 tokens"):
        llm.generate([[3] * 128], SamplingParams(max_tokens=None))


def test_scoring_may_use_the_whole_context(llm):
    """Scoring generates nothing, so a window of exactly max_model_len is valid (perplexity windows)."""
    assert tuple(llm.engine.score([3] * 128).shape) == (128, 256)
    with pytest.raises(ContextLengthError, match="129 tokens exceed this model's context of 128"):
        llm.engine.score([3] * 129)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.engine.score([3, 256])
    llm.engine.kv_manager.check_invariants()
    assert llm.engine.kv_manager.num_free_blocks == 16


def test_request_larger_than_the_whole_cache(llama_dir):
    small = LLM(str(llama_dir), num_blocks=2, block_size=16)
    with pytest.raises(
        CapacityError, match=r"\(\+ 0 lookahead\) need 3 KV blocks; the cache has 2 blocks"
    ):
        small.generate([[3] * 20], SamplingParams(max_tokens=20))


def test_logit_bias_outside_vocab(llm):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate([[3, 4]], SamplingParams(logit_bias={999: 1.0}))


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate("hello", SamplingParams())


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[3, 4, 5], []], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == 16
    # and the engine still serves
    assert len(llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) <= 3


def test_max_model_len_beyond_model_limit(llama_dir):
    with pytest.raises(InvalidRequestError, match="exceeds the model's limit of 512"):
        LLM(str(llama_dir), max_model_len=4096)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_checkpoint_missing_tensors(tmp_path, llama_dir):
    for item in llama_dir.iterdir():
        shutil.copy(item, tmp_path / item.name)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match="missing tensors: .*model.layers.1.mlp.up_proj.weight"
    ):
        LLM(str(tmp_path), num_blocks=8)


def test_checkpoint_with_wrong_shape(tmp_path, llama_dir):
    import torch

    for item in llama_dir.iterdir():
        shutil.copy(item, tmp_path / item.name)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.norm.weight.*shape \(3,\), expected \(64,\)"):
        LLM(str(tmp_path), num_blocks=8)


def test_checkpoint_without_weights(tmp_path, llama_dir):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        LLM(str(tmp_path), num_blocks=8)
