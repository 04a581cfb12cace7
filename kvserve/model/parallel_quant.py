"""Quantised weights on a tensor-parallel rank (docs/parallel.md, docs/quantization.md): the scales
shard with their weights, so every rank multiplies exactly the codes and scales the unsharded
model would.

- Column-parallel projections (qkv_proj, gate_up_proj) and the vocabulary-parallel head split by
  output rows. A row's scales (per channel, or per group of its inputs) depend on that row only, so
  quantising the rank's rows is the same as quantising the whole tensor and slicing its rows.
- Row-parallel projections (o_proj, down_proj) split by input columns. A per-channel scale is the
  whole row's absmax, so the rank quantises the whole checkpoint tensor and keeps its columns of
  the codes with every row's scale (replicated); per-group scales are sliced by group, which needs
  the shard's columns to start and end on a group boundary.

Refused, with the reason: one scale per tensor (a shard's range is not the tensor's), activations
rounded per token or per tensor (w8a8: the rank sees only its shard of a row-parallel input, so the
activation scale would differ from the unsharded model's) and a quantised embedding table (the
vocabulary-parallel lookup has no integer variant).
"""

from __future__ import annotations

import torch

from kvserve.model.linear import make_linear, quantize_linears
from kvserve.model.parallel import (
    RowParallelLinear,
    TensorParallelDecoderLM,
    TensorParallelLayout,
)
from kvserve.model.qlinear import QuantLinear
from kvserve.quant.rtn import QuantizedTensor, quantize
from kvserve.quant.scheme import ACT_NONE, QuantizationError, TensorScheme, WeightScheme


def check_tensor_parallel_scheme(scheme: WeightScheme, layout: TensorParallelLayout) -> None:
    """Raise QuantizationError when `scheme` cannot shard exactly over `layout`."""
    world = layout.world_size
    if scheme.runs_bf16:
        raise QuantizationError(
            f"{scheme.name}: bf16 products run on one rank only for now; with tensor parallelism "
            f"use fp32 or an integer format"
        )
    if scheme.for_class("embed") is not None:
        raise QuantizationError(
            f"{scheme.name}: a quantised embedding table cannot be tensor-parallel yet (the "
            f"vocabulary-parallel lookup is float only); quantise linear= and head= only"
        )
    for cls in ("linear", "head"):
        part = scheme.for_class(cls)
        if part is None:
            continue
        if part.granularity == "tensor":
            raise QuantizationError(
                f"{scheme.name}: one scale per tensor cannot shard over {world} ranks (a shard's "
                f"range is not the tensor's); use a per-channel or grouped format"
            )
        if part.act != ACT_NONE:
            raise QuantizationError(
                f"{scheme.name}: activations rounded per {part.act} cannot be tensor-parallel "
                f"(a row-parallel rank sees only its shard of the input); use int8 or int4-gN"
            )
    linear = scheme.for_class("linear")
    if linear is not None and linear.granularity == "group":
        config = layout.rank_config()
        for name, width in (
            ("o_proj", config.num_heads * config.head_dim),
            ("down_proj", config.intermediate_size),
        ):
            if width % linear.group_size:
                raise QuantizationError(
                    f"{scheme.name}: {name}'s {width} input columns per rank are not a multiple "
                    f"of the group size {linear.group_size}, so its groups would straddle ranks"
                )


def shard_columns(qt: QuantizedTensor, cols: slice) -> QuantizedTensor:
    """Columns `cols` of a quantised [rows, cols] matrix with their scales (whole-row scales for
    per-channel, the groups' own for grouped)."""
    scales, zeros = qt.scales, qt.zeros
    if qt.scheme.granularity == "group":
        size = qt.scheme.group_size
        groups = slice(cols.start // size, cols.stop // size)
        scales = scales[:, groups].contiguous()
        zeros = None if zeros is None else zeros[:, groups].contiguous()
    return QuantizedTensor(qt.scheme, qt.codes[:, cols].contiguous(), scales, zeros)


def quantize_tensor_parallel(
    model: TensorParallelDecoderLM,
    checkpoint: dict[str, torch.Tensor],
    scheme: WeightScheme,
    device: torch.device | str,
) -> None:
    """Quantise rank model `model` (float, before `use_cpu_weights`) in place under `scheme`;
    `checkpoint` is the whole Hugging Face state dict (the row-parallel tensors quantise whole)."""
    check_tensor_parallel_scheme(scheme, model.layout)
    layout, config = model.layout, model.config
    linear: TensorScheme | None = scheme.for_class("linear")
    if linear is not None:
        for index, layer in enumerate(model.layers):
            prefix = f"model.layers.{index}."
            for module, name, cols in (
                (layer.self_attn.o_proj, "self_attn.o_proj", layout.q_rows()),
                (layer.mlp.down_proj, "mlp.down_proj", layout.ffn_rows()),
            ):
                assert isinstance(module, RowParallelLinear)
                full = checkpoint[f"{prefix}{name}.weight"].float()  # [out, in]
                module.linear = QuantLinear(
                    shard_columns(quantize(full, linear), cols), None, device
                )
        kv_rows = config.num_kv_heads * config.head_dim
        splits = {  # the rank's q, k, v and gate, up rows: each quantised as its own tensor
            "qkv_proj": (config.num_heads * config.head_dim, kv_rows, kv_rows),
            "gate_up_proj": (config.intermediate_size, config.intermediate_size),
        }
        quantize_linears(model.layers, linear, device, splits)  # the remaining nn.Linears
    head = scheme.for_class("head")
    if head is not None:  # the rank's vocabulary rows (zero-padded rows quantise to zeros)
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.cpu_head = make_linear(weight, None, head, device)
        model.lm_head = None
