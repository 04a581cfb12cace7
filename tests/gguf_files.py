"""Tiny GGUF files for tests, written with `gguf`'s own writer as llama.cpp's converter writes them.

`write_llama_gguf` turns a tiny random transformers Llama (tests/checkpoints.py) into a GGUF file:
metadata from its config, a byte-level vocabulary of its size, q/k rows permuted as
`convert_hf_to_gguf.py` permutes them, and every matrix quantised to `ggml_type` with
`gguf.quants.quantize`. transformers reads the file back (`gguf_file=`) as the oracle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """GPT-2's 256 byte symbols, then merged pairs of them up to `vocab_size` tokens, with merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens, merges = list(symbols), []
    for a in symbols:
        for b in symbols:
            if len(tokens) >= vocab_size:
                return tokens[:vocab_size], merges
            if a.isalpha() and b.isalpha():
                tokens.append(a + b)
                merges.append(f"{a} {b}")
    return tokens[:vocab_size], merges


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (LlamaModel.permute)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, *rest = hf_name.split(".")
    module, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_NAMES[module]}.{suffix}"


def write_llama_gguf(
    path: Path, model, ggml_type: str = "Q8_0", embed_type: str | None = None,
    chat_template: str | None = CHATML,
) -> Path:  # fmt: skip
    """`model`: a transformers LlamaForCausalLM; matrices in `ggml_type`, the table in `embed_type`
    (default the same), norms F32."""
    import gguf

    config = model.config
    qtype = gguf.GGMLQuantizationType[ggml_type]
    etype = gguf.GGMLQuantizationType[embed_type or ggml_type]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    tokens, merges = byte_vocab(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * len(tokens))
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = _permute(data, heads)
        if data.ndim == 1:
            writer.add_tensor(gguf_name(name), data)
            continue
        kind = etype if name == "model.embed_tokens.weight" else qtype
        writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
