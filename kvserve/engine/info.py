"""What an engine core runs, told to the API process once it is ready (`EngineInfo`)."""

from __future__ import annotations

import torch

from kvserve.engine.wire import EngineInfo
from kvserve.model.kernel_choice import served_kernels
from kvserve.quant.describe import describe_weights
from kvserve.threads import describe_threads


def engine_info(engine) -> EngineInfo:
    """What `engine` (a kvserve.engine.core.EngineCore) runs, as the API process reports it
    (`/manifest`, `/v1/models`)."""
    c = engine.config
    spec = c.speculative
    speculative = (
        "off"
        if spec is None
        else f"{spec.method}"
        + (f" ({spec.draft_model_dir})" if spec.draft_model_dir else "")
        + f", {spec.num_speculative_tokens} tokens per step"
    )
    tok = engine.tokenizer
    return EngineInfo(
        model_dir=str(c.model_dir),
        model_type=c.model.model_type,
        dtype=str(c.dtype),
        device=str(c.device),
        quantization=getattr(c, "quantization", None),
        vocab_size=c.model.vocab_size,
        num_layers=c.model.num_layers,
        max_model_len=engine.max_model_len,
        num_blocks=engine.num_blocks,
        block_size=c.cache.block_size,
        kv_bytes_per_token=int(c.model.kv_bytes_per_token(c.dtype)),
        max_num_seqs=c.scheduler.max_num_seqs,
        max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        enable_prefix_caching=c.cache.enable_prefix_caching,
        admission=str(c.scheduler.admission),
        speculative=speculative,
        tokenizer=None if tok is None else str(getattr(tok, "name_or_path", "") or c.model_dir),
        eos_token_ids=tuple(engine.eos_token_ids),
        threads=describe_threads(torch.get_num_threads()),
        grammar_compile_timeout_s=c.grammar_compile_timeout_s,
        weights=describe_weights(
            str(c.dtype), c.weight_scheme, c.quantization_method, c.model_dir, c.gguf_activations
        ),
        kv_cache_sizing=c.cache.sizing,
        kv_cache_bytes=int(engine.runner.kv_cache_bytes),
        kv_groups=describe_groups(engine.kv_manager.layout),
        blocks_per_full_seq=engine.kv_manager.num_blocks_for(
            engine.max_model_len, c.scheduler.max_num_batched_tokens
        ),
        **served_kernels(
            c.model_dir, c.weight_scheme, getattr(engine.runner.model, "kernel_table", None)
        ),
    )


def describe_groups(layout) -> str:
    """One line on a hybrid layout's KV groups, "" for one table."""
    if not layout.hybrid:
        return ""
    full = sum(g.window is None for g in layout.groups)
    windows = sorted({g.window for g in layout.groups if g.window is not None})
    return (
        f"hybrid: {full} global + {len(layout.groups) - full} sliding-window group(s) (window "
        f"{', '.join(map(str, windows))}) of {layout.group_size} layers; window groups return "
        "blocks their window has left"
    )
