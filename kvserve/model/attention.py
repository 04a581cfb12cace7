"""Paged attention: metadata built once per step, and backends that attend over block tables.

The KV cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim]. A token at
position p of a request lives in slot block_ids[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SingleTokenGroup:
    """Chunks of one new token (a decode step, or a one-token prompt remainder): one batched call."""

    rows: torch.Tensor  # [B] row of each chunk's token in the flat batch
    block_table: torch.Tensor  # [B, max_blocks], padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_context] True where the key is visible


@dataclass(frozen=True)
class MultiTokenChunk:
    """A prompt chunk (or a speculative verification window): attends causally, offset by its start."""

    row_start: int
    row_end: int
    block_ids: torch.Tensor  # [num_blocks_of_context]
    mask: torch.Tensor  # [1, 1, num_new, context_len]
    context_len: int


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    single: SingleTokenGroup | None
    multi: tuple[MultiTokenChunk, ...]
    block_size: int


def build_attention_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """`chunks`: (start_position, num_new_tokens, block_ids) per request, in flat-batch order."""
    slot_parts: list[int | torch.Tensor] = []
    single_rows: list[int] = []
    single_tables: list[list[int]] = []
    single_contexts: list[int] = []
    multi: list[MultiTokenChunk] = []
    row = 0
    for start, num_new, block_ids in chunks:
        context_len = start + num_new
        num_context_blocks = -(-context_len // block_size)
        if num_new == 1:
            slot_parts.append(block_ids[start // block_size] * block_size + start % block_size)
            single_rows.append(row)
            single_tables.append(block_ids[:num_context_blocks])
            single_contexts.append(context_len)
        else:
            query_pos = torch.arange(start, context_len, device=device).unsqueeze(1)
            key_pos = torch.arange(context_len, device=device).unsqueeze(0)
            table = torch.tensor(block_ids[:num_context_blocks], device=device)
            positions = query_pos.squeeze(1)
            slot_parts.append(table[positions // block_size] * block_size + positions % block_size)
            multi.append(
                MultiTokenChunk(
                    row_start=row,
                    row_end=row + num_new,
                    block_ids=table,
                    mask=(key_pos <= query_pos)[None, None],
                    context_len=context_len,
                )
            )
        row += num_new
    single = None
    if single_rows:
        max_blocks = max(len(t) for t in single_tables)
        table = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in single_tables], device=device
        )
        max_context = max(single_contexts)
        key_pos = torch.arange(max_context, device=device)
        contexts = torch.tensor(single_contexts, device=device)
        mask = (key_pos[None, :] < contexts[:, None])[:, None, None, :]
        single = SingleTokenGroup(torch.tensor(single_rows, device=device), table, mask)
    return AttentionMetadata(
        slot_mapping=_concat_slots(slot_parts, device),
        single=single,
        multi=tuple(multi),
        block_size=block_size,
    )


def _concat_slots(parts: list[int | torch.Tensor], device: torch.device) -> torch.Tensor:
    # Single-token chunks give Python ints (cheap), prompt chunks give tensors (no per-token loop).
    tensors = [
        p if isinstance(p, torch.Tensor) else torch.tensor([p], device=device) for p in parts
    ]
    return torch.cat(tensors).long() if tensors else torch.empty(0, dtype=torch.long, device=device)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    # k, v: [T, num_kv_heads, head_dim] -> cache slots
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v


def torch_reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, num_heads, head_dim] -> [T, num_heads, head_dim], reading keys and values from the cache.

    One batched SDPA call for all single-token chunks (keys gathered through a padded block table and masked
    by context length), one call per multi-token chunk.
    """
    out = torch.empty_like(q) if meta.multi else None
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if meta.single is not None:
        group = meta.single
        batch, max_blocks = group.block_table.shape
        max_context = group.mask.shape[-1]
        # [B, max_blocks, block_size, kv_heads, head_dim] -> [B, kv_heads, max_context, head_dim]
        keys = k_cache[group.block_table].view(
            batch, max_blocks * block_size, num_kv_heads, head_dim
        )
        values = v_cache[group.block_table].view(
            batch, max_blocks * block_size, num_kv_heads, head_dim
        )
        keys = keys[:, :max_context].transpose(1, 2)
        values = values[:, :max_context].transpose(1, 2)
        only_single = not meta.multi  # then the rows are 0 .. T-1 in order: no gather, no scatter
        queries = (q if only_single else q[group.rows]).unsqueeze(2)  # [B, num_heads, 1, head_dim]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, scale=scale, enable_gqa=True
        )
        if only_single:
            return attended.squeeze(2)
        out[group.rows] = attended.squeeze(2)
    for chunk in meta.multi:
        num_blocks = chunk.block_ids.shape[0]
        keys = k_cache[chunk.block_ids].view(num_blocks * block_size, num_kv_heads, head_dim)
        values = v_cache[chunk.block_ids].view(num_blocks * block_size, num_kv_heads, head_dim)
        keys = (
            keys[: chunk.context_len].transpose(0, 1).unsqueeze(0)
        )  # [1, kv_heads, ctx, head_dim]
        values = values[: chunk.context_len].transpose(0, 1).unsqueeze(0)
        queries = q[chunk.row_start : chunk.row_end].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=chunk.mask, scale=scale, enable_gqa=True
        )
        out[chunk.row_start : chunk.row_end] = attended.squeeze(0).transpose(0, 1)
    return out


AttentionBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {"torch": torch_reference_attention}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (available: {sorted(ATTENTION_BACKENDS)})"
        )
    return ATTENTION_BACKENDS[name]
