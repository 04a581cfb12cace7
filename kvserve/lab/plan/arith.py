"""The formulas of docs/planning.md, one small function each, for the planner and the simulator's
cost model.


Symbols: L layers, d = n_q d_h the attention width, N_matmul the matmul parameters, W weight bytes,
k KV bytes per token per sequence, t context tokens, T new tokens, B sequences in a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from kvserve.kv.groups import plan_layout
from kvserve.lab.plan.model import ModelSpec


class StepModel(Protocol):
    """A measured decode-step model (kvserve.lab.plan.engine_cost.EngineCost)."""

    def decode_step_s(self, batch: float, mean_context: float) -> float: ...

    def decode_bound(self, batch: float, mean_context: float) -> str: ...


class CommCost(Protocol):
    """Seconds of a step's collectives (kvserve.lab.plan.parallel.TensorParallelComm)."""

    def step_s(self, num_tokens: float, num_sampled: float) -> float: ...


def flops_per_token(model: ModelSpec, context_tokens: float) -> float:
    """FLOPs for one token attending to `context_tokens`: 2 N_matmul + 4 L d t."""
    return 2 * model.num_matmul_params + 4 * model.num_layers * model.q_dim * context_tokens


def prefill_flops(model: ModelSpec, num_tokens: float, num_cached_tokens: float = 0) -> float:
    """Prefill of T new tokens: 2 N_matmul T + 2 L d T^2 (docs/planning.md), plus 4 L d S T when the T tokens
    follow S cached ones (each new token also attends to the cached prefix; an extension of the
    formula in docs/planning.md)."""
    L, d, T, S = model.num_layers, model.q_dim, num_tokens, num_cached_tokens
    return 2 * model.num_matmul_params * T + 2 * L * d * T * T + 4 * L * d * S * T


def kv_bytes_per_token(model: ModelSpec, bytes_per_value: float) -> float:
    """k = 2 L n_kv d_h b: keys and values of one token of one sequence (not query heads)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * bytes_per_value


def kv_bytes_per_sequence(
    model: ModelSpec, bytes_per_value: float, num_tokens: float, block_size: int = 16
) -> float:
    """KV bytes one sequence of `num_tokens` tokens holds. Every layer global: k x tokens. A hybrid
    model (sliding-window and global layers, kv/groups.py) as the engine holds it: each group's blocks,
    window groups only those the next query still sees, times the bytes of a block (one layer per slot,
    `group_size` slots): docs/planning.md "Hybrid models"."""
    if not model.layer_windows:
        return kv_bytes_per_token(model, bytes_per_value) * num_tokens
    layout = plan_layout(model.layer_windows)
    if not layout.hybrid:
        return kv_bytes_per_token(model, bytes_per_value) * num_tokens
    block_bytes = 2 * layout.group_size * model.num_kv_heads * model.head_dim * bytes_per_value
    return layout.blocks_held(math.ceil(num_tokens), block_size) * block_size * block_bytes


def decode_step_bytes(
    weight_bytes: float, kv_bytes_per_token: float, batch: float, mean_context: float
) -> float:
    """Bytes one decode step moves: W + B k t (every weight once, every sequence's cache once)."""
    return weight_bytes + batch * kv_bytes_per_token * mean_context


def decode_step_flops(model: ModelSpec, batch: float, mean_context: float) -> float:
    """FLOPs of one decode step: 2 N_matmul B + 4 L d B t."""
    return batch * flops_per_token(model, mean_context)


def roofline_time_s(
    flops: float, num_bytes: float, bandwidth_bytes_per_s: float, peak_flops_per_s: float
) -> float:
    """max(bytes / BW, FLOPs / peak)."""
    return max(num_bytes / bandwidth_bytes_per_s, flops / peak_flops_per_s)


def decode_step_s(
    model: ModelSpec,
    weight_bytes: float,
    kv_bytes_per_token: float,
    batch: float,
    mean_context: float,
    bandwidth_bytes_per_s: float,
    peak_flops_per_s: float,
) -> float:
    """Decode step for B sequences at mean context t:
    max((W + B k t) / BW, (2 N_matmul B + 4 L d B t) / peak)."""
    return roofline_time_s(
        decode_step_flops(model, batch, mean_context),
        decode_step_bytes(weight_bytes, kv_bytes_per_token, batch, mean_context),
        bandwidth_bytes_per_s,
        peak_flops_per_s,
    )


def prefill_compute_s(
    model: ModelSpec,
    num_tokens: float,
    num_cached_tokens: float,
    peak_flops_per_s: float,
    mfu: float,
) -> float:
    """TTFT estimate (docs/planning.md): prefill FLOPs / (MFU x peak)."""
    return prefill_flops(model, num_tokens, num_cached_tokens) / (mfu * peak_flops_per_s)


def prefill_bytes(
    weight_bytes: float, kv_bytes_per_token: float, num_tokens: float, num_cached_tokens: float = 0
) -> float:
    """Least bytes a prefill moves: the weights once, the cached prefix read, the new KV written."""
    return weight_bytes + kv_bytes_per_token * (num_cached_tokens + num_tokens)


def prefill_s(
    model: ModelSpec,
    weight_bytes: float,
    kv_bytes_per_token: float,
    num_tokens: float,
    num_cached_tokens: float,
    bandwidth_bytes_per_s: float,
    peak_flops_per_s: float,
    mfu: float,
) -> float:
    """One request's prefill alone: docs/planning.md's compute time, floored by the time to read the
    weights and cache once (docs/planning.md's formula omits it; it decides only short or mostly-cached
    prompts)."""
    memory_s = (
        prefill_bytes(weight_bytes, kv_bytes_per_token, num_tokens, num_cached_tokens)
        / bandwidth_bytes_per_s
    )
    return max(
        prefill_compute_s(model, num_tokens, num_cached_tokens, peak_flops_per_s, mfu), memory_s
    )


def free_cache_bytes(memory_bytes: float, weight_bytes: float, overhead_bytes: float) -> float:
    """free = capacity - W - runtime overhead."""
    return memory_bytes - weight_bytes - overhead_bytes


def max_concurrent_sequences(
    free_bytes: float,
    kv_bytes_per_token: float,
    tokens_per_sequence: float,
    bytes_per_sequence: float | None = None,
) -> int:
    """floor(free / (k x (prompt + output))), or free / `bytes_per_sequence` where a hybrid model's
    sequence holds less (`kv_bytes_per_sequence`); 0 when nothing fits."""
    if free_bytes <= 0:
        return 0
    if bytes_per_sequence is None:
        bytes_per_sequence = kv_bytes_per_token * tokens_per_sequence
    return math.floor(free_bytes / bytes_per_sequence)


def max_concurrent_shared_prefix(
    free_bytes: float,
    kv_bytes_per_token: float,
    tokens_per_sequence: float,
    shared_prefix_tokens: float,
) -> int:
    """Like `max_concurrent_sequences` when all sequences share one cached prefix, stored once."""
    free = free_bytes - kv_bytes_per_token * shared_prefix_tokens
    private = tokens_per_sequence - shared_prefix_tokens
    if free <= 0:
        return 0
    if private <= 0:
        raise ValueError("the shared prefix must be shorter than the sequence")
    return math.floor(free / (kv_bytes_per_token * private))


def aggregate_decode_limit_tokens_per_s(
    bandwidth_bytes_per_s: float, kv_bytes_per_token: float, mean_context: float
) -> float:
    """As B grows, B / step approaches BW / (k t): the cache, not the weights, is the traffic."""
    return bandwidth_bytes_per_s / (kv_bytes_per_token * mean_context)


def gemv_intensity(bytes_per_weight: float) -> float:
    """FLOPs per byte of a matrix-vector product: 2 per weight read (bf16 ~1, int8 ~2, int4 ~4)."""
    return 2 / bytes_per_weight


def gemm_intensity(num_rows: int, num_cols: int, batch: int, bytes_per_value: float) -> float:
    """[rows, cols] weight times [cols, B] activations: 2 rows cols B FLOPs over weights + inputs +
    outputs (~2B / b while B is much smaller than the matrix)."""
    flops = 2 * num_rows * num_cols * batch
    return flops / (bytes_per_value * (num_rows * num_cols + (num_rows + num_cols) * batch))


def attention_decode_intensity(model: ModelSpec, kv_bytes_per_value: float) -> float:
    """Decode attention: 4 n_q d_h t FLOPs per layer over 2 n_kv d_h t b bytes = 2 n_q / (n_kv b),
    whatever the batch (each sequence reads its own cache)."""
    return 2 * model.num_heads / (model.num_kv_heads * kv_bytes_per_value)


@dataclass(frozen=True)
class RooflineCost:
    """The formulas above bound to one model, weight size, KV format and roofline: the cost model
    the planner uses and the simulator can reuse. `bandwidth_bytes_per_s` is the achievable one.

    Under tensor parallelism `model`, `weight_bytes` and `kv_bytes_per_token` are one rank's
    (kvserve.lab.plan.parallel.shard_model) and `comm` adds the all-reduces, not overlapped."""

    model: ModelSpec
    weight_bytes: float
    kv_bytes_per_token: float
    bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    mfu: float = 0.5
    comm: CommCost | None = None
    # a measured engine profile's decode step (None: the roofline's max(bytes/BW, FLOPs/peak))
    engine: StepModel | None = None

    def comm_s(self, num_tokens: float, num_sampled: float) -> float:
        return 0.0 if self.comm is None else self.comm.step_s(num_tokens, num_sampled)

    def decode_step_s(self, batch: float, mean_context: float) -> float:
        if self.engine is not None:
            return self.comm_s(batch, batch) + self.engine.decode_step_s(batch, mean_context)
        return self.comm_s(batch, batch) + decode_step_s(
            self.model,
            self.weight_bytes,
            self.kv_bytes_per_token,
            batch,
            mean_context,
            self.bandwidth_bytes_per_s,
            self.peak_flops_per_s,
        )

    def decode_step_bytes(self, batch: float, mean_context: float) -> float:
        return decode_step_bytes(self.weight_bytes, self.kv_bytes_per_token, batch, mean_context)

    def decode_bound(self, batch: float, mean_context: float) -> str:
        """ "memory" or "compute": which term of the max sets the step time (a measured engine
        profile may also say "dispatch": the host cost is the largest part)."""
        if self.engine is not None:
            return self.engine.decode_bound(batch, mean_context)
        memory_s = self.decode_step_bytes(batch, mean_context) / self.bandwidth_bytes_per_s
        compute_s = decode_step_flops(self.model, batch, mean_context) / self.peak_flops_per_s
        return "memory" if memory_s >= compute_s else "compute"

    def decode_intensity(self, batch: float, mean_context: float) -> float:
        flops = decode_step_flops(self.model, batch, mean_context)
        return flops / self.decode_step_bytes(batch, mean_context)

    def prefill_s(self, num_tokens: float, num_cached_tokens: float = 0) -> float:
        return self.comm_s(num_tokens, 1) + prefill_s(
            self.model,
            self.weight_bytes,
            self.kv_bytes_per_token,
            num_tokens,
            num_cached_tokens,
            self.bandwidth_bytes_per_s,
            self.peak_flops_per_s,
            self.mfu,
        )

    def prefill_compute_s(self, num_tokens: float, num_cached_tokens: float = 0) -> float:
        return self.comm_s(num_tokens, 1) + prefill_compute_s(
            self.model, num_tokens, num_cached_tokens, self.peak_flops_per_s, self.mfu
        )
