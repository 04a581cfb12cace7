"""The operator's startup summary: what is served, how much KV cache it has, and where."""

from __future__ import annotations

import math


def startup_summary(engine, served_model_name: str, url: str) -> str:
    """A few lines for the terminal once the model is loaded: model, dtype, KV blocks and tokens,
    how many full-length sequences fit at once, and the URLs."""
    config = engine.config
    block_size = config.cache.block_size
    num_kv_tokens = engine.num_blocks * block_size
    blocks_per_full_seq = math.ceil(engine.max_model_len / block_size)
    max_full_len_seqs = engine.num_blocks // blocks_per_full_seq
    kv_bytes = num_kv_tokens * config.model.kv_bytes_per_token(config.dtype)
    spec = config.speculative
    speculative = (
        "off"
        if spec is None
        else f"{spec.method}"
        + (f" ({spec.draft_model_dir})" if spec.draft_model_dir else "")
        + f", {spec.num_speculative_tokens} tokens per step"
    )
    lines = [
        f"kvserve: serving {served_model_name!r} from {config.model_dir}",
        f"  model      {config.model.model_type}, {config.model.num_layers} layers, "
        f"vocab {config.model.vocab_size:,d}, context {engine.max_model_len:,d} tokens",
        f"  compute    {config.dtype} on {config.device}",
        f"  KV cache   {engine.num_blocks:,d} blocks x {block_size} tokens = {num_kv_tokens:,d} "
        f"tokens ({kv_bytes / 2**20:,.1f} MiB); prefix caching "
        f"{'on' if config.cache.enable_prefix_caching else 'off'}",
        f"  capacity   {max_full_len_seqs:,d} sequences at the full {engine.max_model_len:,d}-token "
        f"length at once (max running sequences {config.scheduler.max_num_seqs})",
        f"  speculative {speculative}",
        f"  URL        {url}  (playground {url}/, dashboard {url}/dashboard, API {url}/v1, "
        f"docs {url}/docs)",
    ]
    return "\n".join(lines)
