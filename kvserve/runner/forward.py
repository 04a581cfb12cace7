"""One forward pass over a flat batch of chunks, shared by the target and the draft model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.config import KVLayout
from kvserve.model.attention import AttentionBackend, build_attention_metadata, cpu_attention
from kvserve.model.decoder import DecoderLM
from kvserve.model.kv_cache import LayerKVCache, allocate_layers

# A prompt chunk attends row by row (below) while its rows x context stays this small: each row reads
# its whole causal context again (a 32-row chunk at ~1,000 positions; docs/performance.md "Small
# steps row by row").
PER_ROW_MAX_WORK = 32 * 1024


def attends_by_row(start: int, num_new: int) -> bool:
    """Whether a chunk of `num_new` tokens at `start` attends row by row: a decode row always; a
    prompt chunk while num_new x (start + num_new) <= PER_ROW_MAX_WORK."""
    return num_new == 1 or num_new * (start + num_new) <= PER_ROW_MAX_WORK


def as_rows(
    spans: Sequence[tuple[int, int, Sequence[int]]],
) -> list[tuple[int, int, Sequence[int]]]:
    """Every new token of a chunk that `attends_by_row` as a chunk of its own (position start + i,
    attending to the keys up to and including its own: its chunk's earlier tokens are written to the
    cache in the same step, before any row attends, on both the fused step and the per-op path);
    other chunks as they are."""
    out: list[tuple[int, int, Sequence[int]]] = []
    for start, n, block_ids in spans:
        if attends_by_row(start, n):
            out.extend((start + i, 1, block_ids) for i in range(n))
        else:
            out.append((start, n, block_ids))
    return out


def forward_chunks(
    model: DecoderLM,
    kv_caches: list[LayerKVCache],
    attention: AttentionBackend,
    chunks: Sequence[tuple[int, Sequence[int], Sequence]],
    block_size: int,
    device: torch.device,
    logit_rows: Sequence[int] | None,
    layout: KVLayout | None = None,
) -> torch.Tensor:
    """`chunks`: (start position, token ids, block ids) per request, in batch order. Writes their K/V into
    `kv_caches` and returns logits [len(logit_rows), V] for the given flat rows (None: every row).
    With a hybrid `layout` (kv/groups.py) the third element is every group's block table
    (`ScheduledChunk.tables`) and each layer attends through its own group's.

    With the CPU kernels, each prompt chunk within `attends_by_row`'s bound runs its tokens as decode
    rows of their own: a prompt token's attention is then the decode kernel's, the same code a decode
    step at that position runs, whatever else the step holds (solo, batched, chunked, after a
    prefix-cache hit: the same bits), and a step of such rows only, at most
    `fused_decode.max_step_rows()` of them, takes the fused step (the decoder's `_fused_for`): one
    native call for all layers instead of ~10 dispatched ops a layer. Longer chunks attend at once
    (torch's flash kernel)."""
    input_ids: list[int] = []
    positions: list[int] = []
    for start, token_ids, _ in chunks:
        input_ids.extend(token_ids)
        positions.extend(range(start, start + len(token_ids)))
    device = torch.device(device)
    by_rows = attention is cpu_attention and device.type == "cpu"

    def metadata(spans):
        if by_rows and any(n > 1 for _, n, _ in spans):
            spans = as_rows(spans)  # a step of rows only, at most the fused step's, runs fused
        return build_attention_metadata(spans, block_size, device)

    if layout is None or not layout.hybrid:
        meta = metadata([(start, len(tokens), block_ids) for start, tokens, block_ids in chunks])
    else:
        per_group = [
            metadata([(start, len(tokens), tables[g]) for start, tokens, tables in chunks])
            for g in range(len(layout.groups))
        ]
        meta = [per_group[g] for g in layout.layer_group]  # one per layer
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
    layout: KVLayout | None = None,
) -> tuple[list[torch.Tensor], list[LayerKVCache]]:
    """The backing tensors ([slots, 2, num_blocks, block_size, num_kv_heads, head_dim] values or codes,
    and for 8-bit caches their scales) and one `LayerKVCache` per layer. A block has one slot per layer,
    or with a hybrid `layout` one per layer of a group: each layer reads its slot through its group's
    block ids, so two groups never share a block (kv/groups.py)."""
    config = model.config
    slots = config.num_layers if layout is None or not layout.hybrid else layout.group_size
    tensors, views = allocate_layers(
        slots,
        num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype,
        kv_cache_dtype,
        device,
    )
    if slots == config.num_layers:
        return tensors, views
    return tensors, [views[slot] for slot in layout.layer_slot]
