"""Quantisation schemes the engine can run, parsed from the format strings `kvserve plan` spells.

A scheme string names one tensor format, or one per tensor class (docs/quantization.md):

- `int8`: symmetric, one fp16 scale per output channel (`int8-g128`: per group of 128 inputs).
- `int4-g32`, `int4-g64`, `int4-g128`: symmetric, one fp16 scale per group of input values.
- `int4-g128-zp`: min-max with an fp16 zero-point per group (`int4-zp`: per channel).
- `int4` is per output channel; `int4-pt`: one scale for the whole tensor (the seed's catastrophe).
- `w8a8`: int8 weights per channel, activations quantised to int8 per token at run time;
  `w8a8-pt`: one activation scale per tensor (the whole batch), as SmoothQuant's static scheme.
- `fp32`, `fp16`: unquantised. `bf16`: on CPU, weights stored in bf16 and multiplied by activations
  rounded to bf16, sums in fp32 (llama.cpp's BF16 matmul; AVX512_BF16 runs it natively); elsewhere
  unquantised. It applies to the block linears and the head (a lookup table stays as it is).
- `linear=int4-g64,embed=int8,head=fp32`: per class; `mixed` is plan's mixed format. A single name
  quantises the block linears only: the embedding and the head keep the model's dtype (what GPTQ and
  AWQ checkpoints ship).

Only what a kernel can run parses: 4- or 8-bit integers, groups a multiple of 32.

The format strings themselves are read here once, for the planner too: `split_weight_format` splits a
scheme into its classes (expanding `mixed`), `lex_tensor_format` reads one class's format into its
parts. `parse_weight_scheme` keeps what kvserve's kernels run; `kvserve.lab.plan.formats` prices any
integer width and group size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvserve.core.errors import InvalidRequestError

SCALE_BITS = 16  # scales and zero-points are stored in fp16
KERNEL_BLOCK = 32  # the kernels quantise activations and walk weights in blocks of 32 inputs
FLOAT_FORMATS = ("fp32", "bf16", "fp16")
CLASSES = ("linear", "embed", "head")
FORMAT_CLASSES = (*CLASSES, "norm")  # norm weights and biases: always float
MIXED = "linear=int4-g128,embed=int8,head=int8,norm=bf16"
ACT_NONE, ACT_TOKEN, ACT_TENSOR = "block", "token", "tensor"
ACT_BLOCK2 = "block2"  # per 32 inputs, the remainder rounded again (GGUF --gguf-activations int8x2)
# --gguf-activations (EngineConfig) -> how the panel kernel rounds a GGUF linear's activations
GGUF_ACTIVATION_ACTS = {"int8": ACT_NONE, "int8x2": ACT_BLOCK2}


class QuantizationError(InvalidRequestError):
    """A quantisation format, method or calibration input that kvserve cannot use."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "quantization")


@dataclass(frozen=True)
class TensorScheme:
    """How one weight matrix is stored and multiplied.

    granularity: "channel" (one scale per output row), "group" (per `group_size` inputs of a row), or
    "tensor" (one scale). act: how the kernel rounds activations to int8: "block" (per 32 inputs of a
    row, llama.cpp's Q8_0 activations: near weight-only accuracy), "token" (one scale per row, W8A8),
    "tensor" (one scale for the whole input, W8A8 per tensor), "block2" ("block", then the remainder
    rounded again with its own scale: two int8 terms per input, within 1/508 of the block's scale of
    the exact value, so near fp32 accuracy at twice the integer products).
    """

    name: str
    bits: int | None  # None: a float format
    granularity: str = "channel"
    group_size: int | None = None
    zero_point: bool = False
    act: str = ACT_NONE

    @property
    def is_float(self) -> bool:
        return self.bits is None

    def group_len(self, num_cols: int) -> int:
        """Inputs per scale for a row of `num_cols` (the last group of a row may be shorter)."""
        return self.group_size if self.granularity == "group" else num_cols

    def num_bits(self, num_rows: int, num_cols: int) -> int:
        """Bits of a [num_rows, num_cols] matrix in this format, every scale and zero-point included
        (docs/quantization.md: int4-g128 is 4 + 16/128 bits per weight)."""
        if self.is_float:
            return num_rows * num_cols * (32 if self.name == "fp32" else 16)
        if self.granularity == "tensor":
            num_scales = 1
        else:
            num_scales = num_rows * math.ceil(num_cols / self.group_len(num_cols))
        return num_rows * num_cols * self.bits + num_scales * SCALE_BITS * (1 + self.zero_point)

    def bits_per_weight(self, num_rows: int, num_cols: int) -> float:
        return self.num_bits(num_rows, num_cols) / (num_rows * num_cols)


_ALIASES = {"int8-pc": "int8", "int8-per-channel": "int8", "w8": "int8", "int4-tensor": "int4-pt"}
FLOAT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8}  # every float format a string may name
_INT_RE = re.compile(r"^int(\d+)(?:-g(\d+))?(-zp)?$")


@dataclass(frozen=True)
class FormatParts:
    """One tensor format string, read: a float (`float_bits`) or `bits`-bit integers with a scale per
    `group_size` inputs (None: per output channel), maybe a zero-point; `variant` "pt" is one scale
    per tensor, "a8" / "a8-pt" int8 activations per token / per tensor (w8a8)."""

    name: str
    float_bits: int | None = None
    bits: int | None = None
    group_size: int | None = None
    zero_point: bool = False
    variant: str = ""


def lex_tensor_format(text: str) -> FormatParts | None:
    """The parts of one tensor format string (aliases resolved), or None if it is not one."""
    name = _ALIASES.get(text.strip().lower(), text.strip().lower())
    if name in FLOAT_BITS:
        return FormatParts(name, float_bits=FLOAT_BITS[name])
    if name in ("w8a8", "w8a8-pt"):
        return FormatParts(name, bits=8, variant=name[2:])  # "a8" or "a8-pt"
    if name == "int4-pt":
        return FormatParts(name, bits=4, variant="pt")
    match = _INT_RE.match(name)
    if match is None:
        return None
    bits, group, zp = int(match.group(1)), match.group(2), bool(match.group(3))
    return FormatParts(
        name, bits=bits, group_size=None if group is None else int(group), zero_point=zp
    )


def split_weight_format(text: str) -> tuple[str, dict[str, str] | None]:
    """(the scheme's name, {class: its format string}), or (name, None) for one format that names no
    class; `mixed` is expanded. Raises ValueError naming an unknown or repeated class."""
    name = text.strip().lower()
    spec = MIXED if name == "mixed" else name
    if "=" not in spec:
        return name, None
    parts: dict[str, str] = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in FORMAT_CLASSES:
            raise ValueError(f"unknown tensor class {key!r}; classes: {', '.join(FORMAT_CLASSES)}")
        if key in parts:
            raise ValueError(f"{key} is given twice")
        parts[key] = value.strip()
    return name, parts


def parse_tensor_scheme(text: str) -> TensorScheme:
    parts = lex_tensor_format(text)
    if parts is None:
        raise QuantizationError(f"unknown quantisation format {text!r}; " + _CHOICES)
    name = parts.name
    if parts.float_bits is not None:
        if name not in FLOAT_FORMATS:
            raise QuantizationError(
                f"unknown quantisation format {text!r} (plan prices it, but kvserve has no kernel "
                "for it); " + _CHOICES
            )
        return TensorScheme(name, None)
    if parts.variant in ("a8", "a8-pt"):
        return TensorScheme(name, 8, act=ACT_TOKEN if parts.variant == "a8" else ACT_TENSOR)
    if parts.variant == "pt":
        return TensorScheme(name, 4, granularity="tensor")
    if parts.bits not in (4, 8):
        raise QuantizationError(
            f"unknown quantisation format {text!r} (plan prices it, but kvserve has no kernel for "
            "it); " + _CHOICES
        )
    group = parts.group_size
    if group is not None and (group <= 0 or group % KERNEL_BLOCK):
        raise QuantizationError(
            f"{text}: the group size must be a positive multiple of {KERNEL_BLOCK}"
        )
    if parts.zero_point and parts.bits == 8:
        raise QuantizationError(f"{text}: int8 is symmetric only (use int8 or int4-g128-zp)")
    return TensorScheme(
        name,
        parts.bits,
        "group" if group else "channel",
        group_size=group,
        zero_point=parts.zero_point,
    )


_CHOICES = (
    "use fp32, bf16, int8, int8-g128, int4, int4-g32, int4-g64, int4-g128, int4-g128-zp, int4-pt, "
    "w8a8, w8a8-pt, or linear=...,embed=...,head=..."
)


@dataclass(frozen=True)
class WeightScheme:
    """A tensor scheme per class: block linears, the embedding table, the LM head. None: unquantised
    (the model's dtype)."""

    name: str
    linear: TensorScheme | None
    embed: TensorScheme | None = None
    head: TensorScheme | None = None

    def __post_init__(self) -> None:
        for cls in ("embed",):
            scheme = getattr(self, cls)
            if scheme is not None and scheme.act != ACT_NONE:
                raise QuantizationError(
                    f"{self.name}: {cls} is a lookup and cannot be {scheme.name}"
                )

    def for_class(self, cls: str) -> TensorScheme | None:
        scheme = getattr(self, cls)
        return None if scheme is None or scheme.is_float else scheme

    @property
    def is_quantized(self) -> bool:
        return any(self.for_class(c) is not None for c in CLASSES)

    def bf16_products(self, cls: str) -> bool:
        """Whether class `cls` is named `bf16`: on CPU its weights are stored in bf16 and multiplied
        by activations rounded to bf16, the sums in fp32 (llama.cpp's BF16; docs/quantization.md)."""
        scheme = getattr(self, cls)
        return scheme is not None and scheme.name == "bf16"

    @property
    def runs_bf16(self) -> bool:
        """Some class is `bf16`: the linears, the head, or the table (which a tied head follows)."""
        return any(self.bf16_products(c) for c in CLASSES)


def parse_weight_scheme(text: str) -> WeightScheme:
    """`int8`, `int4-g128`, `mixed`, `linear=int4-g64,embed=int8,head=fp32`, ... (see module doc)."""
    if not isinstance(text, str) or not text.strip():
        raise QuantizationError("empty quantisation format; " + _CHOICES)
    try:
        name, classes = split_weight_format(text)
    except ValueError as exc:
        raise QuantizationError(f"{text}: {exc}") from None
    if classes is None:
        return WeightScheme(name, parse_tensor_scheme(name))
    norm = classes.pop("norm", None)
    if norm is not None and norm not in FLOAT_FORMATS:
        raise QuantizationError(f"{text}: norm weights must stay float")
    parts = {key: parse_tensor_scheme(value) for key, value in classes.items()}
    return WeightScheme(name, parts.get("linear"), parts.get("embed"), parts.get("head"))
