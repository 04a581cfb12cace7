"""Tiny random checkpoints of every supported architecture, written by `transformers` itself."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
GPT2_TOKENIZER = FIXTURES / "gpt2-tokenizer"

_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Peakier random logits than the default 0.02: greedy ties between near-equal logits would make
    # token-equality checks depend on rounding rather than on the code under test.
    initializer_range=0.1,
)

# name -> (model class name, config class name, extra config)
ARCHS = {
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    "llama_tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


# Architectures with features that some of the suites over ARCHS do not cover (tensor parallel,
# the fused decode step): built by the same function, tested by their own modules.
# Gemma 3: sliding-window layers (window 12, under one 16-token block) beside global ones, a local
# RoPE base and a scaled global one, an attention scale from query_pre_attn_scalar (not head_dim),
# GELU-tanh, a final logit softcap; the norms randomised below (transformers starts them at 0).
SEPARATE_ARCHS = {
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            head_dim=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            sliding_window=12,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            final_logit_softcapping=20.0,
            tie_word_embeddings=True,
        ),
    ),
}


def build_checkpoint(
    path: Path, arch: str = "llama", vocab_size: int = 256, seed: int = 0, **overrides
):
    """Save a random `arch` model to `path`; returns the transformers model (fp32, eval mode)."""
    import torch
    import transformers

    model_cls_name, config_cls_name, extra = (ARCHS | SEPARATE_ARCHS)[arch]
    options = {"bos_token_id": 1, "eos_token_id": 2, **_COMMON, **extra, **overrides}
    config = getattr(transformers, config_cls_name)(vocab_size=vocab_size, **options)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and not param.any():  # offset norms start at 0
                param.normal_(0.0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return model


def build_gpt2_tokenized_checkpoint(path: Path, seed: int = 0, **overrides):
    """A tiny Llama over GPT-2's real tokenizer (byte-level BPE, 50257 tokens, a chat template).
    `overrides` replace the tiny sizes (e.g. a larger model for a benchmark)."""
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    model = build_checkpoint(
        path,
        "llama_tied",
        vocab_size=50257,
        seed=seed,
        bos_token_id=50256,
        eos_token_id=50256,
        **(sizes | overrides),
    )
    for item in GPT2_TOKENIZER.iterdir():
        shutil.copy(item, path / item.name)
    return model
