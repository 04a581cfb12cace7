"""One forward pass over a flat batch of chunks, shared by the target and the draft model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    SingleTokenGroup,
    build_attention_metadata,
)
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
    if torch.device(device).type == "cpu" and chunks and all(len(ids) == 1 for _, ids, _ in chunks):
        ids_t, positions_t, meta = _decode_inputs(chunks, block_size)
    else:
        input_ids: list[int] = []
        positions: list[int] = []
        for start, token_ids, _ in chunks:
            input_ids.extend(token_ids)
            positions.extend(range(start, start + len(token_ids)))
        meta = build_attention_metadata(
            [(start, len(token_ids), list(block_ids)) for start, token_ids, block_ids in chunks],
            block_size,
            device,
        )
        ids_t = torch.tensor(input_ids, device=device)  # [T]
        positions_t = torch.tensor(positions, device=device)  # [T]
    hidden = model(ids_t, positions_t, kv_caches, meta, attention)  # [T, hidden_size]
    if logit_rows is not None and list(logit_rows) != list(range(ids_t.shape[0])):
        hidden = hidden[torch.tensor(logit_rows, device=device, dtype=torch.long)]
    return model.compute_logits(hidden)


def _decode_inputs(
    chunks: Sequence[tuple[int, Sequence[int], Sequence[int]]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A CPU step of one-token chunks (decode rows): the token ids, positions and the attention
    metadata `build_attention_metadata` builds (the same values and dtypes), as views of two numpy
    arrays, one int64 and one int32: 2 conversions instead of 6 tensors built from lists."""
    num_rows = len(chunks)
    contexts = [start + 1 for start, _, _ in chunks]
    num_blocks = [-(-c // block_size) for c in contexts]
    max_blocks = max(num_blocks)
    longs = [token_ids[0] for _, token_ids, _ in chunks]  # ids
    longs += [start for start, _, _ in chunks]  # positions
    longs += [b[s // block_size] * block_size + s % block_size for s, _, b in chunks]  # slots
    longs += range(num_rows)  # rows of the single-token group
    ints = list(contexts)  # then the block tables
    for (_, _, block_ids), n in zip(chunks, num_blocks, strict=True):
        ints += block_ids[:n]
        ints += [0] * (max_blocks - n)  # padded with block 0, as build_attention_metadata
    longs_t = torch.from_numpy(np.array(longs, dtype=np.int64))  # [4 T]
    ints_t = torch.from_numpy(np.array(ints, dtype=np.int32))  # [T + T max_blocks]
    single = SingleTokenGroup(
        longs_t[3 * num_rows :],  # [T]
        ints_t[num_rows:].view(num_rows, max_blocks),  # [T, max_blocks]
        ints_t[:num_rows],  # [T]
        max(contexts),
    )
    meta = AttentionMetadata(longs_t[2 * num_rows : 3 * num_rows], single, (), block_size)
    return longs_t[:num_rows], longs_t[num_rows : 2 * num_rows], meta


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
