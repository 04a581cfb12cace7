"""One forward pass over a flat batch of chunks, shared by the target and the draft model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.model.attention import AttentionBackend, build_attention_metadata
from kvserve.model.decoder import DecoderLM
from kvserve.model.kv_cache import LayerKVCache, allocate_layers


def forward_chunks(
    model: DecoderLM,
    kv_caches: list[LayerKVCache],
    attention: AttentionBackend,
    chunks: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    block_size: int,
    device: torch.device,
    logit_rows: Sequence[int] | None,
) -> torch.Tensor:
    """`chunks`: (start position, token ids, block ids) per request, in batch order. Writes their K/V into
    `kv_caches` and returns logits [len(logit_rows), V] for the given flat rows (None: every row)."""
    input_ids: list[int] = []
    positions: list[int] = []
    for start, token_ids, _ in chunks:
        input_ids.extend(token_ids)
        positions.extend(range(start, start + len(token_ids)))
    meta = build_attention_metadata(
        [(start, len(token_ids), block_ids) for start, token_ids, block_ids in chunks],
        block_size,
        device,
    )
    ids_t = torch.tensor(input_ids, device=device)  # [T]
    positions_t = torch.tensor(positions, device=device)  # [T]
    hidden = model(ids_t, positions_t, kv_caches, meta, attention)  # [T, hidden_size]
    if logit_rows is not None and list(logit_rows) != list(range(ids_t.shape[0])):
        hidden = hidden[torch.tensor(logit_rows, device=device, dtype=torch.long)]
    return model.compute_logits(hidden)


def allocate_kv_cache(
    model: DecoderLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> tuple[list[torch.Tensor], list[LayerKVCache]]:
    """The backing tensors ([num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] values or
    codes, and for 8-bit caches their scales) and one `LayerKVCache` per layer."""
    config = model.config
    return allocate_layers(
        config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
        dtype, kv_cache_dtype, device,
    )  # fmt: skip
