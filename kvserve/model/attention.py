"""Paged attention: metadata built once per step, and backends that attend over block tables.

The KV cache of one layer is a `LayerKVCache` (model/kv_cache.py). Backends take the block tables and read
the cache themselves: `cpu` runs decode rows through a kernel that reads the blocks in place
(model/cpu_kernels.py) and prompt chunks through torch's CPU flash kernel (causal, without a mask);
`torch` gathers each chunk's blocks into a contiguous copy for SDPA with a mask (any device, any dtype).

Sliding-window layers pass their window W to the backend: a query at position p sees the keys at
p - W + 1 .. p (transformers' `sliding_window_overlay`: kv > q - W), and only the blocks that hold
those keys are read (the C kernel starts at the window's first position; the torch paths gather the
window's blocks alone). The cache itself keeps every block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.model.kv_cache import LayerKVCache


@dataclass(frozen=True)
class SingleTokenGroup:
    """Chunks of one new token (a decode step, or a one-token prompt remainder): one batched call."""

    rows: torch.Tensor  # [B] row of each chunk's token in the flat batch
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32: keys visible to each row
    max_context: int

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, max_context] True where the key is visible (torch backend; built once per step)."""
        key_pos = torch.arange(self.max_context, device=self.context_lens.device)
        return (key_pos[None, :] < self.context_lens[:, None])[:, None, None, :]

    @cached_property
    def long_block_table(self) -> torch.Tensor:
        return self.block_table.long()

    @cached_property
    def _windows(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    def windowed(self, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table, mask) of each row's last `window` keys only (torch backend; built once per
        step and window): [B, num_window_blocks] long, [B, 1, 1, num_window_blocks x block_size]."""
        if window not in self._windows:
            context = self.context_lens.long()  # [B]
            first_key = (context - window).clamp(min=0)  # [B]
            first_block = first_key // block_size
            # window keys span at most this many blocks, wherever the window starts
            num_blocks = min((window + block_size - 2) // block_size + 1, self.block_table.shape[1])
            steps = torch.arange(num_blocks, device=context.device)
            index = (first_block[:, None] + steps).clamp(max=self.block_table.shape[1] - 1)
            table = self.long_block_table.gather(1, index)  # [B, num_blocks]
            offsets = torch.arange(num_blocks * block_size, device=context.device)
            key_pos = first_block[:, None] * block_size + offsets  # [B, num_blocks x block_size]
            mask = (key_pos >= first_key[:, None]) & (key_pos < context[:, None])
            self._windows[window] = (table, mask[:, None, None, :])
        return self._windows[window]


@dataclass(frozen=True)
class MultiTokenChunk:
    """A prompt chunk (or a speculative verification window): attends causally, offset by its start."""

    row_start: int
    row_end: int
    block_ids: torch.Tensor  # [num_blocks_of_context]
    context_len: int

    @cached_property
    def mask(self) -> torch.Tensor:
        """[1, 1, num_new, context_len] causal, offset by the cached prefix."""
        device = self.block_ids.device
        start = self.context_len - (self.row_end - self.row_start)
        query_pos = torch.arange(start, self.context_len, device=device).unsqueeze(1)
        key_pos = torch.arange(self.context_len, device=device).unsqueeze(0)
        return (key_pos <= query_pos)[None, None]

    @cached_property
    def _windows(self) -> dict[int, tuple[torch.Tensor, int, torch.Tensor]]:
        return {}

    def windowed(self, window: int, block_size: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """(block ids, first key position, mask [1, 1, num_new, num_keys]) over the keys that some
        query of the chunk sees through a window of `window` keys: from the first query's window
        start, rounded down to its block."""
        if window not in self._windows:
            device = self.block_ids.device
            start = self.context_len - (self.row_end - self.row_start)
            first_block = max(0, start - window + 1) // block_size
            first_key = first_block * block_size
            query_pos = torch.arange(start, self.context_len, device=device).unsqueeze(1)
            key_pos = torch.arange(first_key, self.context_len, device=device).unsqueeze(0)
            mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
            self._windows[window] = (self.block_ids[first_block:], first_key, mask[None, None])
        return self._windows[window]


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    single: SingleTokenGroup | None
    multi: tuple[MultiTokenChunk, ...]
    block_size: int


def build_attention_metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device | str
) -> AttentionMetadata:
    """`chunks`: (start_position, num_new_tokens, block_ids) per request, in flat-batch order.

    Host work is a handful of small tensors per step (no tensor per decode row); a CPU step of decode
    rows only (every chunk one token) takes the numpy route, `_decode_metadata`."""
    if chunks and torch.device(device).type == "cpu" and all(n == 1 for _, n, _ in chunks):
        return _decode_metadata(chunks, block_size)
    return _general_metadata(chunks, block_size, device)


def _decode_metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]], block_size: int
) -> AttentionMetadata:
    """One-token chunks (decode rows) on CPU: what `_general_metadata` builds (the same values and
    dtypes), as views of two numpy arrays, one int64 (slots, rows) and one int32 (context lengths,
    block tables padded with block 0): 2 conversions instead of 4 tensors built from lists."""
    num_rows = len(chunks)
    contexts = [start + 1 for start, _, _ in chunks]
    num_blocks = [-(-c // block_size) for c in contexts]
    max_blocks = max(num_blocks)
    longs = [b[s // block_size] * block_size + s % block_size for s, _, b in chunks]  # slots
    longs += range(num_rows)  # rows of the single-token group
    ints = list(contexts)  # then the block tables
    for (_, _, block_ids), n in zip(chunks, num_blocks, strict=True):
        ints += block_ids[:n]
        ints += [0] * (max_blocks - n)
    longs_t = torch.from_numpy(np.array(longs, dtype=np.int64))  # [2 T]
    ints_t = torch.from_numpy(np.array(ints, dtype=np.int32))  # [T + T max_blocks]
    single = SingleTokenGroup(
        longs_t[num_rows:],  # [T]
        ints_t[num_rows:].view(num_rows, max_blocks),  # [T, max_blocks]
        ints_t[:num_rows],  # [T]
        max(contexts),
    )
    return AttentionMetadata(longs_t[:num_rows], single, (), block_size)


def _general_metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device | str
) -> AttentionMetadata:
    slots: list[int] = []
    single_rows: list[int] = []
    single_tables: list[list[int]] = []
    single_contexts: list[int] = []
    multi: list[MultiTokenChunk] = []
    row = 0
    for start, num_new, block_ids in chunks:
        context_len = start + num_new
        num_context_blocks = -(-context_len // block_size)
        slots.extend(
            block_ids[p // block_size] * block_size + p % block_size
            for p in range(start, context_len)
        )
        if num_new == 1:
            single_rows.append(row)
            single_tables.append(list(block_ids[:num_context_blocks]))
            single_contexts.append(context_len)
        else:
            table = torch.tensor(block_ids[:num_context_blocks], device=device)
            multi.append(MultiTokenChunk(row, row + num_new, table, context_len))
        row += num_new
    single = None
    if single_rows:
        max_blocks = max(len(t) for t in single_tables)
        table = [t + [0] * (max_blocks - len(t)) for t in single_tables]
        single = SingleTokenGroup(
            torch.tensor(single_rows, device=device),
            torch.tensor(table, dtype=torch.int32, device=device),
            torch.tensor(single_contexts, dtype=torch.int32, device=device),
            max(single_contexts),
        )
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        single=single,
        multi=tuple(multi),
        block_size=block_size,
    )


def _single_torch(
    q: torch.Tensor,
    cache: LayerKVCache,
    group: SingleTokenGroup,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [B, num_heads, head_dim] -> [B, num_heads, head_dim]; gathers the padded KV of the group
    (with a window: of the window's blocks only)."""
    _, block_size, num_kv_heads, head_dim = cache.k.shape
    if window is None or group.max_context <= window:  # no key outside any row's window
        table, mask = group.long_block_table, group.mask
    else:
        table, mask = group.windowed(window, block_size)
    batch, max_blocks = table.shape
    max_context = mask.shape[-1]
    keys, values = cache.gather(table, q.dtype)
    # [B, max_blocks, block_size, kv_heads, head_dim] -> [B, kv_heads, max_context, head_dim]
    keys = keys.view(batch, max_blocks * block_size, num_kv_heads, head_dim)
    values = values.view(batch, max_blocks * block_size, num_kv_heads, head_dim)
    keys = keys[:, :max_context].transpose(1, 2)
    values = values[:, :max_context].transpose(1, 2)
    attended = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return attended.squeeze(2)


def _multi_torch(
    q: torch.Tensor,
    cache: LayerKVCache,
    chunk: MultiTokenChunk,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [num_new, num_heads, head_dim] of one chunk -> the same shape, causal over its context
    (with a window: over the window's blocks only)."""
    _, block_size, num_kv_heads, head_dim = cache.k.shape
    if window is None or chunk.context_len <= window:  # no key outside any query's window
        block_ids, first_key, mask = chunk.block_ids, 0, chunk.mask
    else:
        block_ids, first_key, mask = chunk.windowed(window, block_size)
    num_keys = chunk.context_len - first_key
    num_blocks = block_ids.shape[0]
    keys, values = cache.gather(block_ids, q.dtype)
    keys = keys.view(num_blocks * block_size, num_kv_heads, head_dim)[:num_keys]
    values = values.view(num_blocks * block_size, num_kv_heads, head_dim)[:num_keys]
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, num_heads, num_new, head_dim]
        keys.transpose(0, 1).unsqueeze(0),  # [1, kv_heads, num_keys, head_dim]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return attended.squeeze(0).transpose(0, 1)


def _flash_cpu():
    """torch's CPU flash-attention kernel (the one SDPA picks here), which also returns the logsumexp
    of each query's scores; None where this torch lacks it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _multi_cpu(
    q: torch.Tensor,
    cache: LayerKVCache,
    chunk: MultiTokenChunk,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """As `_multi_torch`, without a mask: the chunk's own keys causally (the kernel skips the masked
    blocks, where a mask makes it compute every score), the cached prefix's keys in full, the two
    softmaxes merged by their logsumexps (flash-decoding's merge). A window that hides some key
    from some query of the chunk needs the mask: `_multi_torch` over the window's blocks."""
    flash = _flash_cpu()
    if window is not None and chunk.context_len <= window:
        window = None  # every query sees its whole context: the window is not binding
    if flash is None or q.dtype != torch.float32 or window is not None:
        return _multi_torch(q, cache, chunk, scale, window)
    _, block_size, num_kv_heads, head_dim = cache.k.shape
    num_blocks = chunk.block_ids.shape[0]
    num_new = q.shape[0]
    start = chunk.context_len - num_new
    keys, values = cache.gather(chunk.block_ids, q.dtype)
    # [num_blocks, block_size, kv_heads, head_dim] -> [1, kv_heads, ctx, head_dim]
    keys = keys.view(num_blocks * block_size, num_kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
    values = values.view(num_blocks * block_size, num_kv_heads, head_dim).transpose(0, 1)[None]
    query = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, num_new, head_dim]
    end = chunk.context_len
    own, own_lse = flash(
        query, keys[:, :, start:end], values[:, :, start:end], 0.0, True, scale=scale
    )  # [1, num_heads, num_new, head_dim], [1, num_heads, num_new]
    if start > 0:
        prefix, prefix_lse = flash(
            query, keys[:, :, :start], values[:, :, :start], 0.0, False, scale=scale
        )
        lse = torch.logaddexp(own_lse, prefix_lse)
        own = own * (own_lse - lse).exp_().unsqueeze(-1)
        own += prefix * (prefix_lse - lse).exp_().unsqueeze(-1)
    return own.squeeze(0).transpose(0, 1)  # [num_new, num_heads, head_dim]


# (q, cache, group or chunk, scale, window) -> attended
SingleAttention = Callable[
    [torch.Tensor, LayerKVCache, SingleTokenGroup, float, "int | None"], torch.Tensor
]
MultiAttention = Callable[
    [torch.Tensor, LayerKVCache, MultiTokenChunk, float, "int | None"], torch.Tensor
]


def _attend(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    single_fn: SingleAttention,
    multi_fn: MultiAttention = _multi_torch,
) -> torch.Tensor:
    """q: [T, num_heads, head_dim] -> [T, num_heads, head_dim]: one call for the decode rows, one per
    multi-token chunk."""
    if meta.single is not None and not meta.multi:
        return single_fn(q, cache, meta.single, scale, window)  # rows are 0 .. T-1 in order
    out = torch.empty_like(q)
    if meta.single is not None:
        out[meta.single.rows] = single_fn(q[meta.single.rows], cache, meta.single, scale, window)
    for chunk in meta.multi:
        out[chunk.row_start : chunk.row_end] = multi_fn(
            q[chunk.row_start : chunk.row_end], cache, chunk, scale, window
        )
    return out


def torch_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Reference backend: every chunk's KV gathered into a contiguous copy, then SDPA. `window`:
    the keys each query sees (itself and the window - 1 before it); None: its whole context."""
    return _attend(q, cache, meta, scale, window, _single_torch)


def _single_cpu(
    q: torch.Tensor,
    cache: LayerKVCache,
    group: SingleTokenGroup,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    from kvserve.model.cpu_kernels import paged_decode

    if not cache.quantised and cache.k.dtype != torch.float32 or q.dtype != torch.float32:
        raise ValueError("the cpu attention backend runs fp32 models; use the torch backend")
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = q.new_empty(q.shape)  # [B, num_heads, head_dim]
    paged_decode(
        q,
        cache.k,
        cache.v,
        cache.k_scale,
        cache.v_scale,
        cache.kind,
        group.block_table,
        group.context_lens,
        scale,
        out,
        window or 0,
    )
    return out


def cpu_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Decode rows read the paged cache in place (C kernel, fp32 model; with a window, only the
    window's positions); prompt chunks through torch's CPU flash kernel without a mask (causal over
    the chunk, the cached prefix in full) where no window hides a key, else `_multi_torch`."""
    return _attend(q, cache, meta, scale, window, _single_cpu, _multi_cpu)


# (q, cache, metadata, scale, window) -> attended; window None (the default): full attention
AttentionBackend = Callable[..., torch.Tensor]

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {"torch": torch_attention, "cpu": cpu_attention}


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """`auto`: the in-place CPU kernel for fp32 models on CPU when it builds here, else `torch`."""
    if name == "auto":
        from kvserve.model.cpu_kernels import kernel_available

        use_cpu = device.type == "cpu" and dtype == torch.float32 and kernel_available()
        name = "cpu" if use_cpu else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (available: auto, {', '.join(ATTENTION_BACKENDS)})"
        )
    return ATTENTION_BACKENDS[name]
