"""CPU weight layouts for the linear layers (projections and the LM head).

Decode multiplies a handful of rows by every weight matrix, so on a CPU each step streams all weights from
memory and the GEMM kernel decides how close it gets to the bandwidth bound. Measured on this project's
2-core AMD EPYC, fp32, 30 distinct 576x3072 weights (read from DRAM as in a model, bound ~354 us):

    rows                      1        4       16      128
    F.linear ([out, in])    633 us   878 us  1054 us
    x @ W^T ([in, out])     369 us   968 us  1248 us   1114 us (576x960)
    oneDNN, packed          372 us   380 us   498 us    740 us (576x960)

MKL's sgemm is 2-3x off the bound for 2-16 rows; oneDNN with the weight reordered once into its blocked
layout stays near it (2-7x faster than the other two there, 1.1-1.5x for prefill-sized row counts). So on
CPU every linear becomes `PackedLinear` where torch ships oneDNN (x86 builds do), else `TransposedLinear`,
which is the fastest plain layout for one row. Accelerators keep `nn.Linear`. Where the C kernels build,
`PackedLinear` runs the native fp32 panel GEMM instead of oneDNN at every row count (it measured 1.0-1.5x
oneDNN from 16 to 2048 rows; docs/performance.md, "The fp32 panel GEMM").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import fused_decode
from kvserve.model.kernel_choice import (  # the one place that decides
    bf16_products_kernel,
    bucket_index,
)
from kvserve.model.qlinear import QuantEmbedding, QuantLinear, check_token_ids
from kvserve.quant.convert import concat_rows
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import TensorScheme, WeightScheme

# oneDNN picks its blocked layout for an expected row count; 16 rows (a decode batch) measured well for
# 1 to 512 rows.
_PACK_ROWS_HINT = 16


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build can run a prepacked oneDNN linear (checked by running one)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(4, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 8.0)))
    except (AttributeError, RuntimeError):
        return False


# kernel_choice.bf16_products_kernel() -> the load log's name (a "scalar" one is flagged slow)
_PRODUCTS_KERNEL_NAMES = {
    "vdpbf16ps": "bf16dot-avx512bf16",
    "avx512-fma": "bf16dot-avx512",
    "portable": "bf16dot-scalar",
    "torch": "bf16dot-torch",
}


class PackedLinear(nn.Module):
    """y = x W^T + b with W laid out once for a packed CPU kernel.

    Where the C kernels build, W is laid out as fp32 panels (`panels`, csrc/decode_step.h: 16
    output columns interleaved per input, N padded to a multiple of 16) and every fp32 input runs
    the native panel GEMM on them (`fused_decode.small_linear`, any number of rows); the fused
    decode step reads the same panels. It has no per-call setup (oneDNN's costs ~35 us a call) and
    measured at least as fast as oneDNN's packed GEMM from 1 to 2048 rows on this project's AVX2
    machine (1.0-1.5x; docs/performance.md, "The fp32 panel GEMM"), so oneDNN's copy of W is not
    kept. Without the C kernels (or for other dtypes) W is reordered once into oneDNN's blocked
    layout (`packed`, an opaque tensor held as a plain attribute: no state_dict entry)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, bf16_products: bool = False
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.bf16_products = bf16_products
        self._desc = None
        # per row bucket (model/kernel_table.py: 1, 2, 4, ... 512 rows) the torch kernel that runs
        # it, None for the panels; None for no table (`--kernel-choice own`)
        self.row_kernels: tuple | None = None
        if bf16_products:
            self._init_bf16_products(weight)
            return
        use_panels = fused_decode.max_rows() > 0 and weight.dtype == torch.float32
        # [P, in, 16]: bf16 when every weight is a bf16 value (a bf16 checkpoint): the same products
        # from half the bytes (the kernels widen each weight back to its fp32 value)
        panel_dtype = (
            torch.bfloat16 if use_panels and fused_decode.bf16_exact(weight) else torch.float32
        )
        self.panels = fused_decode.f32_panels(weight, panel_dtype) if use_panels else None
        # the portable loops (a CPU without AVX2) are ~40x slower than oneDNN at prefill sizes:
        # there the panels take decode rows only, and oneDNN's copy stays for the rest
        if not use_panels:
            self.small_rows = 0
        elif fused_decode.isa() != "scalar":
            self.small_rows = -1  # every row count
        else:
            self.small_rows = fused_decode.max_rows()
        self.packed = (
            None
            if self.small_rows == -1
            else torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        )
        if self.panels is not None:
            self._keep: list = []
            self._desc = fused_decode.linear_descriptor(self, self._keep)

    def native_descriptor(self, keep: list):
        """This projection on its panels for the C kernels (fused_decode.linear_descriptor); None
        without them."""
        if self.panels is None:
            return None
        return fused_decode.panel_descriptor(
            self.panels, self.out_features, self.in_features, self.bias, keep
        )

    def _init_bf16_products(self, weight: torch.Tensor) -> None:
        """bf16 products, fp32 sums (`--quantization linear=bf16`, csrc/bf16dot.c): the weights rounded
        to bf16 once, in the pair layout (`fused_decode.bf16_pair_panels`), and each input row rounded
        to bf16 by the kernel. Without the C kernels the same products come from torch (its own
        summation order)."""
        self.small_rows, self.packed = -1, None
        if fused_decode.max_rows() > 0:
            self.panels = fused_decode.bf16_pair_panels(weight)
            self._keep = []
            self._desc = fused_decode.linear_descriptor(self, self._keep)
        else:  # the bf16 values as fp32 (exact), subnormals flushed as the kernels read them
            self.panels = None
            self.weight_bf16 = (
                fused_decode.flush_subnormals(weight.detach().float()).to(torch.bfloat16).float()
            )

    @property
    def products_kernel(self) -> str:
        """What runs the bf16 products: vdpbf16ps ("bf16dot-avx512bf16"), its emulation on AVX-512
        FMAs, the portable loops ("bf16dot-scalar", slower than fp32), or torch without the C
        kernels; "" for an fp32 linear."""
        if not self.bf16_products:
            return ""
        return _PRODUCTS_KERNEL_NAMES[bf16_products_kernel()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_kernels is not None:
            num_rows = x.numel() // self.in_features
            run = self.row_kernels[bucket_index(num_rows)]
            if run is not None:
                y = run(x.reshape(-1, self.in_features).float())  # [M, in] -> [M, out]
                return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.bf16_products and self._desc is None:
            rows = fused_decode.flush_subnormals(x.float()).to(torch.bfloat16).float()
            bias = None if self.bias is None else self.bias.float()
            return F.linear(rows, self.weight_bf16, bias).to(x.dtype)
        if self._desc is not None and (
            self.small_rows == -1 or (x.dim() == 2 and x.shape[0] <= self.small_rows)
        ):
            rows = x.reshape(-1, self.in_features).float()  # [..., in] -> [M, in]
            y = fused_decode.small_linear(self._desc, rows)  # [M, out]
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PanelEmbedding(nn.Module):
    """A tied fp32 embedding table served from its head's panels (`fused_decode.f32_panels`,
    [P, hidden, 16]): row r is `panels[r // 16, :, r % 16]`, so the table needs no copy of its own
    beside the head's (it held a third one before: the table, oneDNN's copy and the panels)."""

    def __init__(self, panels: torch.Tensor, num_embeddings: int) -> None:
        super().__init__()
        self.panels = panels  # the head's tensor, shared (not a parameter: no state_dict entry)
        self.num_embeddings = num_embeddings
        self.embedding_dim = panels.shape[1]

    def native_table(self) -> tuple[torch.Tensor, int]:
        """The tied head's panels and the table's rows, for the fused decode step's own embedding
        lookup (fused_decode.embedding_table)."""
        return self.panels, self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [T] -> [T, hidden]; the two index tensors broadcast ahead of the sliced dim
        check_token_ids(input_ids, self.num_embeddings)  # the padded columns would index silently
        rows = self.panels[input_ids // fused_decode.FPANEL, :, input_ids % fused_decode.FPANEL]
        return rows.float()  # bf16 panels: their values widened, exact (fp32: no copy)


class TransposedLinear(nn.Module):
    """y = x W^T + b with W stored as W^T ([in_features, out_features], contiguous)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight_t  # [T, in] @ [in, out] -> [T, out]
        return out if self.bias is None else out + self.bias


def cpu_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, bf16_products: bool = False
) -> nn.Module:
    """The fastest available CPU module computing x W^T + b for `weight` [out, in] (`bf16_products`:
    bf16(x) bf16(W)^T + b, sums in fp32)."""
    if bf16_products:
        return PackedLinear(weight.float(), bias, bf16_products=True)
    if weight.dtype == torch.float32 and onednn_available():
        return PackedLinear(weight, bias)
    return TransposedLinear(weight, bias)


def use_cpu_linears(module: nn.Module, bf16_products: bool = False) -> nn.Module:
    """Replace every nn.Linear below `module` by `cpu_linear` of the same weights."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, cpu_linear(child.weight, child.bias, bf16_products))
        else:
            use_cpu_linears(child, bf16_products)
    return module


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scheme: TensorScheme | None = None,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The linear module for `weight` [out, in]: quantised by RTN in `scheme` (QuantLinear: integer
    kernels on CPU); `bf16` on CPU: bf16 products (`cpu_linear`), as the loader builds a class
    named `bf16`; else the fastest float layout on CPU, else nn.Linear's function on `device`."""
    if scheme is not None and not scheme.is_float:
        return QuantLinear(quantize(weight, scheme), bias, device)
    if torch.device(device).type == "cpu":
        products = scheme is not None and scheme.name == "bf16"
        return cpu_linear(weight, bias, bf16_products=products)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def quantize_linears(
    module: nn.Module,
    scheme: TensorScheme,
    device: torch.device | str,
    splits: dict[str, tuple[int, ...]] | None = None,
) -> int:
    """Replace every nn.Linear below `module` by a QuantLinear of its weights; returns how many.
    `splits` gives the row blocks of fused projections (qkv_proj: q, k, v): each block is quantised
    as the checkpoint tensor it came from (it matters for one scale per tensor)."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            rows = (splits or {}).get(name, (child.weight.shape[0],))
            parts = [quantize(w, scheme) for w in child.weight.split(list(rows))]
            setattr(module, name, QuantLinear(concat_rows(parts), child.bias, device))
            count += 1
        else:
            count += quantize_linears(child, scheme, device, splits)
    return count


def apply_weight_scheme(model: nn.Module, scheme: WeightScheme) -> None:
    """Quantise a loaded DecoderLM in place by round-to-nearest: block linears, the LM head (as
    `cpu_head`, which compute_logits prefers) and the embedding table, each by its class's scheme.
    A tied head follows `embed` unless `head` is named. Unquantised parts are left for
    `use_cpu_weights`."""
    device = model.embed_tokens.weight.device
    tied = model.lm_head is None
    if device.type == "cpu":  # bf16 products: a CPU kernel (elsewhere bf16 is the model's dtype)
        if scheme.bf16_products("linear"):
            use_cpu_linears(model.layers, bf16_products=True)
        if scheme.bf16_products("head") or (
            tied and scheme.head is None and scheme.bf16_products("embed")
        ):
            weight = model.embed_tokens.weight if tied else model.lm_head.weight
            model.cpu_head = cpu_linear(weight, None, bf16_products=True)
            model.lm_head = None
    if (linear := scheme.for_class("linear")) is not None:
        cfg = model.config
        kv_rows = cfg.num_kv_heads * cfg.head_dim
        splits = {
            "qkv_proj": (cfg.num_heads * cfg.head_dim, kv_rows, kv_rows),
            "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size),
        }
        quantize_linears(model.layers, linear, device, splits)
    # a named head keeps its own format (a float one included); else a tied head follows the table
    if scheme.head is not None:
        head = scheme.for_class("head")
    else:
        head = scheme.for_class("embed") if tied else None
    if head is not None:
        weight = model.embed_tokens.weight if tied else model.lm_head.weight
        model.cpu_head = make_linear(weight, None, head, device)
        model.lm_head = None
    elif tied and model.cpu_head is None and scheme.for_class("embed") is not None:
        # a named float head whose tied table is quantised below: the head from the float table
        model.cpu_head = make_linear(model.embed_tokens.weight, None, None, device)
        model.lm_head = None
    if (embed := scheme.for_class("embed")) is not None:
        table = model.embed_tokens.weight
        model.embed_tokens = QuantEmbedding(quantize(table, embed), table.dtype, device)
