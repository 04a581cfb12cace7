"""Weight and KV-cache storage formats, and the bytes they take (docs/planning.md: scales count).

Format strings:

- `bf16`, `fp16`, `fp32`: every tensor in that float format.
- `int8` (per output channel, one fp16 scale per row), `int4-g128` (one fp16 scale per 128 input
  values), `int4-g128-zp` (plus an fp16 zero-point per group), any `int{2..8}[-gN][-zp]`: the block
  linears are quantised; embeddings, an untied head and 1-D tensors stay bf16 (what GPTQ / AWQ
  checkpoints ship).
- `linear=int4-g128,embed=int8,head=int8,norm=bf16`: per category; a category not named stays bf16.
- `mixed`: the example above (int4-g128 linears, 8-bit embedding and head, bf16 norms and biases).

The strings are read by the quantiser's own reader (kvserve.quant.scheme: `split_weight_format`,
`lex_tensor_format`), so the planner and the engine agree on every name; the planner prices widths and
group sizes kvserve has no kernel for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.lab.plan.model import ModelSpec, PlanError, TensorShape
from kvserve.quant.scheme import (
    FLOAT_BITS,
    FORMAT_CLASSES,
    SCALE_BITS,
    lex_tensor_format,
    split_weight_format,
)

CATEGORIES = FORMAT_CLASSES


@dataclass(frozen=True)
class TensorFormat:
    """How one tensor is stored: a float format, or integers with fp16 scales (and optional
    zero-points) per group of `group_size` input values (None: per output channel, i.e. one group
    per row)."""

    name: str
    bits: int
    is_float: bool
    group_size: int | None = None
    zero_point: bool = False

    @property
    def nominal_bits_per_weight(self) -> float | None:
        """Bits per weight including scales when groups are fixed-size (int4-g128: 4.125); None for
        per-channel, whose overhead depends on the row length (8 + 16 / num_cols)."""
        if self.is_float:
            return float(self.bits)
        if self.group_size is None:
            return None
        return self.bits + SCALE_BITS * (1 + self.zero_point) / self.group_size

    def num_bytes(self, tensor: TensorShape) -> float:
        """Bytes of `tensor` in this format: values plus scales and zero-points. A row whose length
        is not a multiple of the group size keeps a partial last group (ceil)."""
        values_bits = tensor.num_rows * tensor.num_cols * self.bits
        if self.is_float:
            return values_bits * tensor.count / 8
        if tensor.num_rows == 1:
            raise PlanError(
                f"{self.name}: 1-D tensor {tensor.name} cannot be integer-quantised; "
                "give `norm` a float format"
            )
        group = self.group_size or tensor.num_cols
        num_groups = tensor.num_rows * math.ceil(tensor.num_cols / group)
        scale_bits = num_groups * SCALE_BITS * (1 + self.zero_point)
        return (values_bits + scale_bits) * tensor.count / 8


def parse_tensor_format(text: str) -> TensorFormat:
    parts = lex_tensor_format(text)
    if parts is not None and parts.float_bits is not None:
        return TensorFormat(parts.name, parts.float_bits, is_float=True)
    if parts is None or parts.variant == "pt" or not 2 <= parts.bits <= 8:
        raise PlanError(
            f"unknown tensor format {text.strip().lower()!r}: use bf16, fp16, fp32, fp8, int8, "
            "int4-g128, int4-g64, int4-g128-zp, ..."
        )
    if parts.group_size is not None and parts.group_size <= 0:
        raise PlanError(f"{parts.name}: group size must be positive")
    # w8a8 stores int8 weights per output channel: its bytes are int8's
    return TensorFormat(
        parts.name,
        parts.bits,
        is_float=False,
        group_size=parts.group_size,
        zero_point=parts.zero_point,
    )


@dataclass(frozen=True)
class WeightFormat:
    """A storage format per tensor category; a tied embedding table (also the head) uses `embed`."""

    name: str
    linear: TensorFormat
    embed: TensorFormat
    head: TensorFormat
    norm: TensorFormat

    def __post_init__(self) -> None:
        if not self.norm.is_float:
            raise PlanError(f"{self.name}: norm weights and biases must stay float")

    def for_category(self, category: str) -> TensorFormat:
        return getattr(self, category)

    def weight_bytes(self, model: ModelSpec) -> float:
        """W: sum over tensors of count x bits / 8, including scales and zero-points."""
        return sum(self.for_category(t.category).num_bytes(t) for t in model.tensors())

    def bytes_by_category(self, model: ModelSpec) -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for t in model.tensors():
            out[t.category] += self.for_category(t.category).num_bytes(t)
        return out

    def bits_per_weight(self, model: ModelSpec) -> float:
        """Effective bits per parameter over the whole model, scales included."""
        return 8 * self.weight_bytes(model) / model.num_params


def parse_weight_format(text: str) -> WeightFormat:
    try:
        text, classes = split_weight_format(text)
    except ValueError as exc:
        raise PlanError(f"{text.strip().lower()}: {exc}") from None
    bf16 = parse_tensor_format("bf16")
    if classes is not None:
        parts = {key: parse_tensor_format(value) for key, value in classes.items()}
        return WeightFormat(text, **{c: parts.get(c, bf16) for c in CATEGORIES})
    fmt = parse_tensor_format(text)
    if fmt.is_float:
        return WeightFormat(text, fmt, fmt, fmt, fmt)
    return WeightFormat(text, linear=fmt, embed=bf16, head=bf16, norm=bf16)


# The formats the planner tabulates for every model (the chosen one is added when not among them).
STANDARD_FORMATS = (
    "fp32",
    "bf16",
    "int8",
    "int4-g128",
    "int4-g128-zp",
    "int4-g64",
    "int4-g32",
    "mixed",
)


@dataclass(frozen=True)
class KVFormat:
    """KV-cache value format. int8 keeps one fp16 scale per token per KV head (1 + 2 / d_h bytes per
    value); fp8 uses one per-tensor scale (negligible)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in ("fp32", "bf16", "fp16", "fp8", "int8"):
            raise PlanError(f"unknown KV dtype {self.name!r}: use bf16, fp16, fp32, fp8 or int8")

    def bytes_per_value(self, head_dim: int) -> float:
        """b in docs/planning.md's k = 2 L n_kv d_h b."""
        if self.name == "int8":
            return 1 + SCALE_BITS / 8 / head_dim
        return FLOAT_BITS[self.name] / 8
