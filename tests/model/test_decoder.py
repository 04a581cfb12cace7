"""Unit tests for the decoder's parts (kvserve/model/decoder.py, kvserve/model/rope.py), each against
the transformers module it reimplements, on random weights and inputs: the norms, the gated MLP, the
rotary tables and their rope scalings, and the checks that refuse a model the decoder cannot run.
The whole model's logits against transformers are tests/model/test_model_equivalence.py's."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kvserve.config import ModelConfig
from kvserve.core.errors import UnsupportedModelError
from kvserve.model import cpu_kernels
from kvserve.model.decoder import MLP, OffsetRMSNorm, RMSNorm, norm_class
from kvserve.model.registry import get_arch
from kvserve.model.rope import RotaryEmbedding, apply_rotary

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16


def llama_dict(**overrides) -> dict:
    raw = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    }
    raw.update(overrides)
    return raw


def both_configs(**overrides) -> tuple[ModelConfig, LlamaConfig]:
    raw = llama_dict(**overrides)
    return ModelConfig.from_dict(raw), LlamaConfig(**raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama(dtype):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(HIDDEN, 1e-5), LlamaRMSNorm(HIDDEN, eps=1e-5)
    weight = torch.randn(HIDDEN)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = torch.randn(7, HIDDEN, dtype=dtype) * 3
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_add_norm_is_norm_of_the_sum_and_returns_the_sum():
    torch.manual_seed(1)
    for norm in (RMSNorm(HIDDEN, 1e-6), OffsetRMSNorm(HIDDEN, 1e-6)):
        norm.weight.data.normal_()
        x, residual = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
        normed, summed = norm.add_norm(x, residual)
        torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
        torch.testing.assert_close(normed, norm(x + residual), rtol=0, atol=0)
        alone, same = norm.add_norm(x, None)  # the first layer: no residual yet
        assert same is x
        torch.testing.assert_close(alone, norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rms_norm_matches_gemma3(dtype):
    torch.manual_seed(2)
    ours, theirs = OffsetRMSNorm(HIDDEN, 1e-6), Gemma3RMSNorm(HIDDEN, eps=1e-6)
    weight = torch.randn(HIDDEN) * 0.1
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = torch.randn(6, HIDDEN, dtype=dtype)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.skipif(not cpu_kernels.kernel_available(), reason="the C kernels do not build here")
def test_offset_rms_norm_on_the_c_kernel_matches_its_torch_ops(monkeypatch):
    """With the C kernels (DecoderLM.use_cpu_kernels) Gemma's norm runs csrc/layer_ops.c add_rms_norm
    scaled by 1 + w: within an ulp or two of its torch ops (the sum of squares in another order),
    the residual's sum bit for bit, the q / k norms' [T, heads, D] shape kept, a row's bits the same
    alone and among other rows, and a changed weight used at once (1 + w is cached per weight)."""
    gen = torch.Generator().manual_seed(4)
    norm = OffsetRMSNorm(HIDDEN, 1e-6)
    norm.weight.data.copy_(torch.randn(HIDDEN, generator=gen))
    x, residual = torch.randn(9, HIDDEN, generator=gen) * 3, torch.randn(9, HIDDEN, generator=gen)
    heads = torch.randn(5, 4, HIDDEN, generator=gen)
    want = [norm(x), *norm.add_norm(x, residual), norm(heads)]
    calls = []
    kernel = cpu_kernels.add_rms_norm
    monkeypatch.setattr(cpu_kernels, "add_rms_norm", lambda *a: calls.append(a) or kernel(*a))
    norm.cpu_kernels = True
    got = [norm(x), *norm.add_norm(x, residual), norm(heads)]
    assert len(calls) == 3  # each call ran on the kernel
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], x + residual)
    assert torch.equal(norm(x[3:4]), got[0][3:4])  # a row alone: the same bits
    assert norm.add_norm(x, None)[1] is x
    with torch.no_grad():
        norm.weight.mul_(2.0)
    norm.cpu_kernels = False
    doubled = norm(x)
    norm.cpu_kernels = True
    torch.testing.assert_close(norm(x), doubled, rtol=1e-6, atol=1e-6)


def test_norm_class_follows_the_architecture():
    assert norm_class(get_arch("llama")) is RMSNorm
    assert norm_class(get_arch("gemma3_text")) is OffsetRMSNorm


def test_gated_mlp_matches_llama_silu():
    torch.manual_seed(3)
    config, hf_config = both_configs()
    ours, theirs = MLP(config), LlamaMLP(hf_config)
    ours.gate_up_proj.weight.data.copy_(
        torch.cat([theirs.gate_proj.weight.data, theirs.up_proj.weight.data])
    )
    ours.down_proj.weight.data.copy_(theirs.down_proj.weight.data)
    x = torch.randn(9, HIDDEN)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_gated_mlp_matches_gemma3_gelu_tanh():
    torch.manual_seed(4)
    hf_config = Gemma3TextConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_activation="gelu_pytorch_tanh"
    )
    config = ModelConfig.from_dict(llama_dict(hidden_activation="gelu_pytorch_tanh"))
    ours, theirs = MLP(config), Gemma3MLP(hf_config)
    ours.gate_up_proj.weight.data.copy_(
        torch.cat([theirs.gate_proj.weight.data, theirs.up_proj.weight.data])
    )
    ours.down_proj.weight.data.copy_(theirs.down_proj.weight.data)
    x = torch.randn(4, HIDDEN)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_an_unknown_activation_is_refused_by_name():
    config = ModelConfig.from_dict(llama_dict(hidden_act="relu2"))
    with pytest.raises(UnsupportedModelError, match="relu2"):
        MLP(config)


ROPE_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
]


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=["default", "linear", "llama3"])
def test_rotary_matches_llama(scaling):
    """cos/sin tables and the rotation of q and k, at positions spread past the original context
    (where llama3's scaling bends the frequencies)."""
    overrides = {} if scaling is None else {"rope_scaling": scaling}
    config, hf_config = both_configs(**overrides)
    ours = RotaryEmbedding(config, max_positions=2048)
    theirs = LlamaRotaryEmbedding(hf_config)
    positions = torch.tensor([0, 1, 5, 255, 256, 1000, 2047])
    torch.manual_seed(5)
    q = torch.randn(len(positions), HEADS, HEAD_DIM)
    k = torch.randn(len(positions), KV_HEADS, HEAD_DIM)
    q_ours, k_ours = apply_rotary(q, k, ours(positions))
    # transformers: [batch, heads, T, head_dim] with cos/sin [batch, T, head_dim] (both halves)
    cos, sin = theirs(q, positions[None])
    q_theirs, k_theirs = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    torch.testing.assert_close(q_ours, q_theirs[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_theirs[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rotary_keeps_the_input_dtype_and_rotates_in_fp32():
    config, _ = both_configs()
    rope = RotaryEmbedding(config, max_positions=64)(torch.arange(3))
    q = torch.randn(3, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.randn(3, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    q_out, k_out = apply_rotary(q, k, rope)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    q32, k32 = apply_rotary(q.float(), k.float(), rope)
    torch.testing.assert_close(q_out, q32.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(k_out, k32.to(torch.bfloat16), rtol=0, atol=0)


def test_position_zero_is_the_identity():
    config, _ = both_configs()
    rope = RotaryEmbedding(config, max_positions=8)(torch.tensor([0]))
    q, k = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    q_out, k_out = apply_rotary(q, k, rope)
    torch.testing.assert_close(q_out, q, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k, rtol=0, atol=0)


def test_an_unknown_rope_scaling_is_refused_by_name():
    config = ModelConfig.from_dict(llama_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        RotaryEmbedding(config, max_positions=16)
