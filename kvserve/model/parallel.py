"""Tensor-parallel decoder over torch.distributed (docs/parallel.md): one rank's share of a
`DecoderLM`, loaded straight from the checkpoint's slices.

The Megatron split, as vLLM, SGLang, nano-vllm and gpt-fast do it:

- qkv_proj and gate_up_proj are column-parallel: rank r holds its query heads, its KV heads (split,
  or one head replicated when N > n_kv) and its 1/N of the FFN columns; no communication.
- o_proj and down_proj are row-parallel (`RowParallelLinear`): the rank's input rows, one all-reduce
  of the [tokens, hidden] partial sums, then the bias (added once, after the sum).
- The embedding is vocabulary-parallel (`VocabParallelEmbedding`): rank r holds rows
  [r V_r, (r+1) V_r) of the table (V_r = ceil(V / N), the last shard zero-padded); ids outside its
  range look up zeros, and an all-reduce adds the shards. The head (tied: the same shard) computes
  the rank's [S, V_r] logits and an all-gather assembles [S, V] on every rank.
- Norms (and Qwen3's per-head q/k norms) are replicated. Each rank's KV cache holds only its KV
  heads: `kvserve.runner.forward.allocate_kv_cache` of the rank model is 1/N of the whole (n_kv
  divisible by N).

Sampling: every rank gets the full logits, so the engine may sample on rank 0 and send the token
ids with the next step's input (the scheduler lives beside rank 0), or sample on every rank with the
same seed; all-gather costs a ring the same bytes as a gather to rank 0. The engine
(kvserve/runner/executor.py) samples on rank 0 and sets `logits_rank = 0`: the shards are gathered
onto rank 0 only, and the other ranks' `compute_logits` return their own [S, V_r] shard.

The rank model is a `DecoderLM` of the rank's shapes with three kinds of modules swapped, so the
attention backend, RoPE, the CPU linear layout (`use_cpu_weights`) and `forward_chunks` apply to it
unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.core.errors import ModelLoadError, UnsupportedModelError
from kvserve.gguf.reader import open_gguf
from kvserve.gguf.source import gguf_source
from kvserve.gguf.weights import read_gguf_weights
from kvserve.model.decoder import DecoderLM
from kvserve.model.loader import TORCH_DTYPES, read_checkpoint
from kvserve.model.registry import ArchSpec, get_arch


@dataclass(frozen=True)
class TensorParallelLayout:
    """Which slice of each sharded tensor rank `rank` of `world_size` holds."""

    rank: int
    world_size: int
    config: ModelConfig  # the whole model's

    def __post_init__(self) -> None:
        n, c = self.world_size, self.config
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} outside a world of {n}")
        c.check_tensor_parallel(n)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        """n_kv / N, or 1 when N > n_kv (that head replicated on N / n_kv ranks)."""
        return max(1, self.config.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        n, kv = self.world_size, self.config.num_kv_heads
        return self.rank * kv // n if kv >= n else self.rank // (n // kv)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        return math.ceil(self.config.vocab_size / self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def rank_config(self) -> ModelConfig:
        """The rank's shapes; `vocab_size` stays the whole vocabulary (the gathered logits')."""
        return replace(
            self.config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )

    def q_rows(self) -> slice:
        d_h = self.config.head_dim
        return slice(self.rank * self.num_heads * d_h, (self.rank + 1) * self.num_heads * d_h)

    def kv_rows(self) -> slice:
        d_h = self.config.head_dim
        return slice(self.kv_head_start * d_h, (self.kv_head_start + self.num_kv_heads) * d_h)

    def ffn_rows(self) -> slice:
        f = self.intermediate_size
        return slice(self.rank * f, (self.rank + 1) * f)

    def vocab_rows(self, table: torch.Tensor) -> torch.Tensor:
        """Rows [start, start + V_r) of a [V, hidden] table, zero-padded past V."""
        shard = table[self.vocab_start : self.vocab_start + self.vocab_per_rank]
        missing = self.vocab_per_rank - shard.shape[0]
        return F.pad(shard, (0, 0, 0, missing)) if missing else shard


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: this rank's input rows of the weight, partial sums added over
    the ranks, the (replicated) bias once. `linear` is a plain nn.Linear so the CPU layout swaps it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group=None) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _all_reduce(self.linear(x), self.group)  # [T, out_features], summed over ranks
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + V_r) of the table; other ids look up zeros; all-reduce."""

    def __init__(self, layout: TensorParallelLayout, group=None) -> None:
        super().__init__(layout.vocab_per_rank, layout.config.hidden_size)
        self.vocab_start = layout.vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0.0)
        return _all_reduce(hidden, self.group)


class TensorParallelDecoderLM(DecoderLM):
    """One rank's `DecoderLM`: the rank's shapes, row-parallel o/down projections, a
    vocabulary-parallel embedding and head; `compute_logits` returns the whole [S, V] on every
    rank."""

    def __init__(
        self, layout: TensorParallelLayout, arch: ArchSpec, max_positions: int, group=None
    ) -> None:
        config = layout.rank_config()
        super().__init__(config, arch, max_positions)
        self.layout = layout
        self.group = group
        self.logits_rank: int | None = None  # None: all-gather; a rank: gather onto it only
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(layout, group)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(hidden, layout.vocab_per_rank, bias=False)
        q_size = config.num_heads * config.head_dim
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(q_size, hidden, config.attention_bias, group)
            mlp.down_proj = RowParallelLinear(
                config.intermediate_size, hidden, config.mlp_bias, group
            )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = super().compute_logits(hidden).contiguous()  # [S, V_r] fp32
        world = self.layout.world_size
        if world == 1:
            return local[:, : self.config.vocab_size]
        if self.logits_rank is None:
            shards = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(shards, local, group=self.group)
        elif self.layout.rank == self.logits_rank:
            shards = [torch.empty_like(local) for _ in range(world)]
            dist.gather(local, shards, dst=self.logits_rank, group=self.group)
        else:
            dist.gather(local, None, dst=self.logits_rank, group=self.group)
            return local  # [S, V_r]: this rank does not sample
        return torch.cat(shards, dim=-1)[:, : self.config.vocab_size]  # [S, V]


def _hf(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def shard_tensor(
    name: str, checkpoint: dict[str, torch.Tensor], layout: TensorParallelLayout
) -> torch.Tensor:
    """This rank's slice of parameter `name` (of TensorParallelDecoderLM) from the HF checkpoint."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return layout.vocab_rows(checkpoint[_hf(name)])
    prefix, _, leaf = name.rpartition(".")  # leaf: weight | bias
    if prefix.endswith("self_attn.qkv_proj"):
        base = _hf(prefix.removesuffix("qkv_proj"))
        return torch.cat(
            [
                checkpoint[f"{base}q_proj.{leaf}"][layout.q_rows()],
                checkpoint[f"{base}k_proj.{leaf}"][layout.kv_rows()],
                checkpoint[f"{base}v_proj.{leaf}"][layout.kv_rows()],
            ]
        )
    if prefix.endswith("mlp.gate_up_proj"):
        base = _hf(prefix.removesuffix("gate_up_proj"))
        rows = layout.ffn_rows()
        gate, up = checkpoint[f"{base}gate_proj.{leaf}"], checkpoint[f"{base}up_proj.{leaf}"]
        return torch.cat([gate[rows], up[rows]])
    if prefix.endswith(("self_attn.o_proj.linear", "mlp.down_proj.linear")):
        full = checkpoint[_hf(prefix.removesuffix(".linear")) + f".{leaf}"]
        cols = layout.q_rows() if "o_proj" in prefix else layout.ffn_rows()
        return full[:, cols]
    # norms, q/k norms, and the row-parallel biases (added after the all-reduce): replicated
    return checkpoint[_hf(name.replace(".linear.", "."))]


def read_float_checkpoint(
    model_dir: str | Path, config: ModelConfig, dtype: str = "float32"
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by Hugging Face name, float: a safetensors directory's as stored; a
    GGUF file's (a directory written by `gguf_model_dir`) dequantised to fp32 exactly as
    `gguf.quants.dequantize` does, the converter's q/k row order and norm offset undone, so they shard
    like a safetensors checkpoint (transformers reads a GGUF file the same way, `gguf_file=`)."""
    gguf_file = gguf_source(model_dir)
    if gguf_file is None:
        return read_checkpoint(Path(model_dir))
    if dtype != "float32":
        raise ModelLoadError(
            f"{gguf_file}: a GGUF model runs tensor-parallel with fp32 activations (--dtype "
            "float32): its weights are dequantised to fp32 at load"
        )
    tensors = read_gguf_weights(
        open_gguf(gguf_file), config.num_heads, config.num_kv_heads, keep_blocks=False
    )
    return {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def shard_state_dict(
    model_dir: str | Path,
    layout: TensorParallelLayout,
    names: list[str],
    dtype: str = "float32",
) -> dict[str, torch.Tensor]:
    checkpoint = read_float_checkpoint(model_dir, layout.config, dtype)
    try:
        return {
            n: shard_tensor(n, checkpoint, layout).to(TORCH_DTYPES[dtype]).contiguous()
            for n in names
        }
    except KeyError as exc:
        raise ModelLoadError(f"{model_dir}: checkpoint is missing tensor {exc.args[0]}") from exc


def check_tensor_parallel_arch(config: ModelConfig) -> ArchSpec:
    """The architecture of `config`, if model/parallel.py can shard it."""
    arch = get_arch(config.model_type)
    if not arch.tensor_parallel:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} does not run tensor-parallel yet: use "
            "--tensor-parallel-size 1"
        )
    return arch


def load_tensor_parallel_model(
    model_dir: str | Path,
    config: ModelConfig,
    max_positions: int,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    cpu_weights: bool = True,
) -> TensorParallelDecoderLM:
    """Rank `rank`'s model, reading only the checkpoint (every rank reads its own slices). The
    process group must be initialised (gloo on CPU, NCCL on CUDA) when world_size > 1."""
    arch = check_tensor_parallel_arch(config)
    layout = TensorParallelLayout(rank, world_size, config)
    with torch.device("meta"):
        model = TensorParallelDecoderLM(layout, arch, max_positions, group)
    expected = model.state_dict()
    state = shard_state_dict(model_dir, layout, list(expected), dtype)
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ModelLoadError(
                f"{model_dir}: shard of {name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(expected[name].shape)}"
            )
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    model.build_rotary(device)
    if cpu_weights and torch.device(device).type == "cpu":
        model.use_cpu_weights()
    return model.eval()
