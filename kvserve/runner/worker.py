"""Tensor-parallel ranks (docs/parallel.md): how every rank loads its shard, and the loop of ranks
1..N-1, which run in worker processes started by `kvserve.runner.executor`.

A worker owns its shard of the weights and its KV heads of the cache, and keeps each request's block
tables (core/block_tables.py). It receives each target forward's input over a pipe from rank 0: the
block-table changes since the last forward, (request id, start position, token ids) per chunk, and
the logit rows. It runs the same forward (meeting rank 0 at every all-reduce and at the logits
gather) and waits for the next. It never samples: rank 0 does, beside the scheduler. Commands travel over
the pipe rather than a collective so that an idle engine is not a collective timing out, and so that
a worker sees the engine process end (the pipe's EOF) and exits.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from kvserve.config import EngineConfig
from kvserve.core.block_tables import BlockTables
from kvserve.model.attention import get_attention_backend
from kvserve.model.loader import TORCH_DTYPES
from kvserve.model.parallel import (
    TensorParallelDecoderLM,
    load_tensor_parallel_model,
    read_float_checkpoint,
)
from kvserve.runner.forward import allocate_kv_cache, forward_chunks

# Commands rank 0 sends: ("forward", block-table operations, chunks, logit rows) | ("stop",).
# Replies: ("ready", weight bytes, KV bytes) once loaded, ("error", traceback text) before a failing
# worker exits.
FORWARD, STOP, READY, ERROR = "forward", "stop", "ready", "error"


@dataclass(frozen=True)
class RankSpec:
    """Where rank `rank` of `world_size` runs and how it joins the process group."""

    rank: int
    world_size: int
    init_method: str  # file://PATH (one host: a file store) or tcp://HOST:PORT (node 0's TCPStore)
    backend: str  # gloo | nccl
    device: str  # cpu | cuda:N
    num_threads: int  # torch intra-op threads of this rank (CPU)
    timeout_s: float  # every collective, and the rendezvous

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")


def init_rank(spec: RankSpec, store=None) -> None:
    """Join the process group: through `store` when given (rank 0 across hosts owns the TCPStore),
    else through `spec.init_method`."""
    import torch.distributed as dist

    torch.set_num_threads(spec.num_threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    if store is None and spec.init_method.startswith("tcp://"):
        # a client of node 0's TCPStore, passed as a store as rank 0 passes its own (an init_method
        # would put the keys under another prefix than rank 0's)
        host, _, port = spec.init_method[len("tcp://") :].rpartition(":")
        store = dist.TCPStore(
            host, int(port), spec.world_size, False, timedelta(seconds=spec.timeout_s)
        )
    where = {"store": store} if store is not None else {"init_method": spec.init_method}
    dist.init_process_group(
        spec.backend,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
        **where,
    )


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, measured from its tensors."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def load_rank_model(
    config: EngineConfig, rank: int, world_size: int, device: str
) -> tuple[TensorParallelDecoderLM, int]:
    """Rank `rank`'s model, ready to run, and its weight bytes (measured from the float shard's
    tensors, before any quantisation or CPU layout). The process group must be initialised."""
    model = load_tensor_parallel_model(
        config.model_dir,
        config.model,
        config.scheduler.max_model_len,
        rank,
        world_size,
        dtype=config.dtype,
        device=device,
        cpu_weights=False,
    )
    weight_bytes = state_bytes(model)
    scheme = config.weight_scheme
    if scheme is not None:
        from kvserve.model.parallel_quant import quantize_tensor_parallel

        if scheme.is_quantized:
            checkpoint = read_float_checkpoint(config.model_dir, config.model, config.dtype)
            quantize_tensor_parallel(model, checkpoint, scheme, device)
    if torch.device(device).type == "cpu":
        model.use_cpu_weights()
    if config.attention_backend == "torch":  # the pure-torch reference path throughout
        model.use_cpu_kernels(False)
    model.logits_rank = 0  # rank 0 samples: gather the logits there only
    return model, weight_bytes


def worker_main(spec: RankSpec, config: EngineConfig, num_blocks: int, conn) -> None:
    """Entry point of ranks 1..N-1 (a spawned process)."""
    import torch.distributed as dist

    try:
        init_rank(spec)
        model, weight_bytes = load_rank_model(config, spec.rank, spec.world_size, spec.device)
        device = torch.device(spec.device)
        dtype = TORCH_DTYPES[config.dtype]
        attention = get_attention_backend(config.attention_backend, device, dtype)
        block_size = config.cache.block_size
        kv_tensors, kv_caches = allocate_kv_cache(
            model, num_blocks, block_size, dtype, device, config.cache.kv_cache_dtype
        )
        tables = BlockTables(len(config.kv_layout.groups))
        conn.send((READY, weight_bytes, sum(t.numel() * t.element_size() for t in kv_tensors)))
        with torch.inference_mode():
            while True:
                try:
                    command = conn.recv()
                except EOFError:  # the engine process is gone
                    break
                if command[0] == STOP:
                    break
                _, ops, chunks, rows = command
                tables.apply_ops(ops)
                spans = [(start, tokens, tables.get(rid)[0]) for rid, start, tokens in chunks]
                forward_chunks(model, kv_caches, attention, spans, block_size, device, rows)
    except BaseException:
        try:
            conn.send((ERROR, f"rank {spec.rank} (pid {os.getpid()}): {traceback.format_exc()}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
