"""The operator's startup summary: what is served, how much KV cache it has, and where."""

from __future__ import annotations

import math

from kvserve.core.runs import compact_runs


def startup_summary(info, served_model_name: str, url: str, num_cores: int = 1) -> str:
    """A few lines for the terminal once the model is loaded (`info`: an engine core's EngineInfo):
    model, dtype, weight format, KV blocks and tokens and how their number was chosen, how many full-length sequences fit at once, and the URLs."""
    block_size = info.block_size
    num_kv_tokens = info.num_blocks * block_size
    blocks_per_full_seq = info.blocks_per_full_seq or math.ceil(info.max_model_len / block_size)
    max_full_len_seqs = info.num_blocks // blocks_per_full_seq
    kv_bytes = info.kv_cache_bytes or num_kv_tokens * info.kv_bytes_per_token
    cores = f"; {num_cores} engine cores (data parallel), each with" if num_cores > 1 else ""
    lines = [
        f"kvserve: serving {served_model_name!r} from {info.model_dir}",
        f"  model      {info.model_type}, {info.num_layers} layers, "
        f"vocab {info.vocab_size:,d}, context {info.max_model_len:,d} tokens",
        f"  compute    {info.dtype} on {info.device}{cores}",
        f"  weights    {info.weights or info.quantization or info.dtype}",
        f"  KV cache   {info.num_blocks:,d} blocks x {block_size} tokens = {num_kv_tokens:,d} "
        f"tokens ({kv_bytes / 2**20:,.1f} MiB); prefix caching "
        f"{'on' if info.enable_prefix_caching else 'off'}",
        f"  KV sizing  {info.kv_cache_sizing or 'given'}",
        *([f"  KV groups  {info.kv_groups}"] if info.kv_groups else []),
        f"  capacity   {max_full_len_seqs:,d} sequences at the full {info.max_model_len:,d}-token "
        f"length at once (max running sequences {info.max_num_seqs})",
        f"  speculative {info.speculative}",
        f"  threads    {info.threads}",
        *_kernel_lines(info),
        f"  URL        {url}  (playground {url}/, dashboard {url}/dashboard, API {url}/v1, "
        f"docs {url}/docs)",
    ]
    return "\n".join(lines)


def _kernel_lines(info) -> list[str]:
    """The matrix engine and the per-shape GEMM choice (model/kernel_table.py), one line a shape:
    "576x1536/f32  1-64 panel-f32, 128-512 onednn-f32"."""
    lines = [f"  matrix     {info.matrix_engine}"] if info.matrix_engine else []
    for shape, per_bucket in info.kernel_table.items():
        lines.append(f"  gemm       {shape}  {compact_runs(per_bucket)}")
    return lines
