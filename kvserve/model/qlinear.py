"""Quantised linear layers and embedding tables (docs/quantization.md).

`QuantLinear` keeps the weight as packed integer codes: on CPU with the C kernel library, in the
panel-interleaved layout of kvserve/model/csrc/qgemv.c (`pack_panels`, built once here; every row
count runs it), else in the row layout of kvserve's integer GEMM extension
(kvserve/quant/csrc/qgemm.cpp); both round activations to int8 and take integer dot products per 32
inputs. Where neither can run (no compiler, or an accelerator), it multiplies by the dequantised
weight after rounding the activations the same way, so every device computes the same function, and
it says so in `kernel`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import fused_decode
from kvserve.quant.kernels import kernel_isa, kernels_available
from kvserve.quant.rtn import QuantizedTensor
from kvserve.quant.scheme import ACT_BLOCK2, ACT_TENSOR, ACT_TOKEN, KERNEL_BLOCK, TensorScheme

PANEL = 8  # output columns interleaved in the native GEMV's layout (csrc/decode_step.h QPANEL)

logger = logging.getLogger(__name__)
_ACT_MODES = {"block": 0, ACT_TOKEN: 1, ACT_TENSOR: 2, ACT_BLOCK2: 3}  # decode_step.h


def round_activations(x: torch.Tensor, act: str) -> torch.Tensor:
    """x [M, K] fp32 -> the values the kernel multiplies: int8 codes times their scale, one scale per
    32 inputs of a row ("block"), per row ("token") or for all of x ("tensor"). Same arithmetic as the
    C++ kernel (fp32 scale = absmax / 127, round half to even). "block2": the "block" values plus the
    remainder's own "block" rounding (the kernel multiplies the two terms separately and adds)."""
    if act == ACT_BLOCK2:
        first = round_activations(x, "block")
        return first + round_activations(x - first, "block")
    num_rows, num_cols = x.shape
    padded_cols = math.ceil(num_cols / KERNEL_BLOCK) * KERNEL_BLOCK
    xp = F.pad(x, (0, padded_cols - num_cols)).reshape(num_rows, -1, KERNEL_BLOCK)
    if act == "block":
        amax = xp.abs().amax(dim=2, keepdim=True)  # [M, nb, 1]
    elif act == ACT_TOKEN:
        amax = xp.abs().amax(dim=(1, 2), keepdim=True)  # [M, 1, 1]
    else:
        amax = xp.abs().amax().reshape(1, 1, 1)
    scale = amax / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(xp * inv).clamp(-127, 127)
    return (codes * scale).reshape(num_rows, padded_cols)[:, :num_cols]


def pack_for_kernel(qt: QuantizedTensor) -> dict[str, torch.Tensor | int]:
    """The kernel layout of `qt` (see qgemm.cpp): codes padded to a multiple of 32 inputs, int4 as
    nibbles (low: element j of a block, high: element j + 16), scales and zeros as fp32 [N, G]."""
    num_rows, num_cols = qt.codes.shape
    padded_cols = math.ceil(num_cols / KERNEL_BLOCK) * KERNEL_BLOCK
    num_blocks = padded_cols // KERNEL_BLOCK
    scheme = qt.scheme
    if scheme.granularity == "group":
        blocks_per_group = scheme.group_size // KERNEL_BLOCK
    else:
        blocks_per_group = num_blocks  # one scale per row
    scales = qt.scales.float().expand(num_rows, -1).contiguous()
    codes = F.pad(qt.codes, (0, padded_cols - num_cols))
    if scheme.bits == 8:
        return {"w": codes.contiguous(), "scales": scales, "bpg": blocks_per_group}
    if qt.zeros is None:
        unsigned = (codes.to(torch.int16) + 8).to(torch.uint8)  # symmetric int4 as zero-point 8
        zeros = torch.full_like(scales, 8.0)
    else:
        unsigned = codes.to(torch.uint8)
        zeros = qt.zeros.float().expand(num_rows, -1).contiguous()
    blocks = unsigned.reshape(num_rows, num_blocks, 2, KERNEL_BLOCK // 2)
    nibbles = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)  # [N, nb, 16]
    return {
        "w": nibbles.reshape(num_rows, padded_cols // 2).contiguous(),
        "scales": scales,
        "zeros": zeros,
        "bpg": blocks_per_group,
    }


def _panel_rows(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """[N, G] per-column values -> [P, G, 8] fp16 (panel, group, column in the panel), zero-padded."""
    t = F.pad(t.half(), (0, 0, 0, padded_rows - t.shape[0]))
    return t.reshape(padded_rows // PANEL, PANEL, -1).transpose(1, 2).contiguous()


def pack_panels(qt: QuantizedTensor) -> dict[str, torch.Tensor | int | None]:
    """The panel-interleaved layout of the native GEMV (kvserve/model/csrc/decode_step.h): output
    columns padded to a multiple of 8 and inputs to a multiple of 32 (zeros); panel p holds columns
    8p .. 8p + 7, block b of 32 inputs as 4-input groups of the 8 columns (one 32-byte vector each).
    int8: w [P, nb, 8, 8, 4] = codes[8p + c, 32b + 4j + t] at [p, b, j, c, t]. int4: w [P, nb, 4, 8, 4]
    uint8, low nibble input 32b + 4j + t and high nibble input 32b + 16 + 4j + t, unsigned codes
    (symmetric: code + 8 and zeros None). scales / zeros: [P, G, 8] fp16 (the checkpoint's, exact)."""
    num_rows, num_cols = qt.codes.shape
    padded_cols = math.ceil(num_cols / KERNEL_BLOCK) * KERNEL_BLOCK
    padded_rows = math.ceil(num_rows / PANEL) * PANEL
    num_blocks, num_panels = padded_cols // KERNEL_BLOCK, padded_rows // PANEL
    scheme = qt.scheme
    if scheme.granularity == "group":
        blocks_per_group = scheme.group_size // KERNEL_BLOCK
    else:
        blocks_per_group = num_blocks  # one scale per row
    scales = _panel_rows(qt.scales.expand(num_rows, -1), padded_rows)
    codes = F.pad(qt.codes, (0, padded_cols - num_cols, 0, padded_rows - num_rows))  # [Np, Kp]
    layout = {"scales": scales, "zeros": None, "bpg": blocks_per_group}
    if scheme.bits == 8:
        w = codes.reshape(num_panels, PANEL, num_blocks, 8, 4).permute(0, 2, 3, 1, 4)
        return layout | {"w": w.contiguous()}
    if qt.zeros is None:
        unsigned = (codes.to(torch.int16) + 8).to(torch.uint8)  # symmetric int4 as zero-point 8
    else:
        unsigned = codes.to(torch.uint8)
        layout["zeros"] = _panel_rows(qt.zeros.expand(num_rows, -1), padded_rows)
    halves = unsigned.reshape(num_panels, PANEL, num_blocks, 2, 4, 4)  # [P, c, nb, half, j, t]
    nibbles = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)  # [P, c, nb, j, t]
    return layout | {"w": nibbles.permute(0, 2, 3, 1, 4).contiguous()}


class QuantLinear(nn.Module):
    """y = round_act(x) W_q^T + b with W_q kept as integer codes (fp32 output)."""

    def __init__(
        self, qt: QuantizedTensor, bias: torch.Tensor | None, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.scheme: TensorScheme = qt.scheme
        self.out_features, self.in_features = qt.codes.shape
        self.act_mode = _ACT_MODES[qt.scheme.act]
        self.bias = None if bias is None else bias.detach().float().contiguous().to(device)
        device = torch.device(device)
        self.layout = "dequantized"
        if device.type == "cpu" and fused_decode.max_rows():
            # the native GEMV / GEMM of csrc/qgemv.c for any number of rows, on the panel layout
            # (repacked here once; the only copy of the codes)
            self.layout = "panel"
            self.kernel = f"kvq-int{qt.scheme.bits}-{fused_decode.isa()}"
            packed = pack_panels(qt)
            self.w, self.scales, self.zeros = packed["w"], packed["scales"], packed["zeros"]
            self.bpg = packed["bpg"]
            self.weight_deq = None
            self._keep: list = []
            self._desc = fused_decode.linear_descriptor(self, self._keep)
        elif device.type == "cpu" and kernels_available() and qt.scheme.act != ACT_BLOCK2:
            # (the row-layout extension rounds activations once; "block2" takes the path below)
            # no C library for ctypes: the torch extension (qgemm.cpp) on its row layout
            self.layout = "rows"
            self.kernel = f"kvq-int{qt.scheme.bits}-{kernel_isa()}"
            packed = pack_for_kernel(qt)
            self.w, self.scales, self.bpg = packed["w"], packed["scales"], packed["bpg"]
            self.zeros = packed.get("zeros")
            self.weight_deq = None
            if qt.scheme.bits == 8:
                self._op = torch.ops.kvq.q8_linear.default
                self._args = (self.w, self.scales, self.bpg, self.bias, self.act_mode)
            else:
                self._op = torch.ops.kvq.q4_linear.default
                self._args = (self.w, self.scales, self.zeros, self.bpg, self.bias, self.act_mode)
        else:
            self.kernel = "dequantized-fp32" if device.type == "cpu" else f"dequantized-{device}"
            self.weight_deq = qt.dequantize().to(device)  # [out, in]

    def native_descriptor(self, keep: list):
        """This projection on the panel layout for the C kernels (fused_decode.linear_descriptor);
        None on another layout."""
        if self.layout != "panel":
            return None
        return fused_decode.quant_panel_descriptor(
            self.scheme.bits,
            self.out_features,
            self.in_features,
            self.w,
            self.scales,
            self.zeros,
            self.bias,
            self.bpg,
            self.act_mode,
            keep,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]; the op takes any strides and float dtype (one call: decode runs
        # ~120 of these per token, so Python work here costs as much as the matmul)
        if self.layout == "panel":
            if x.dim() == 2 and x.dtype == torch.float32 and x.shape[0]:
                return fused_decode.small_linear(self._desc, x)  # [M, in] -> [M, out]
            x2 = x.reshape(-1, self.in_features).float()  # [M, in]
            if x2.shape[0] == 0:
                return x.new_empty(*x.shape[:-1], self.out_features)
            y = fused_decode.small_linear(self._desc, x2)
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.layout == "rows":
            return self._op(x, *self._args)
        x2 = x.reshape(-1, self.in_features).float()
        y = F.linear(round_activations(x2, self.scheme.act), self.weight_deq, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.scheme.name}, {self.kernel}"


def check_token_ids(input_ids: torch.Tensor, num_embeddings: int) -> None:
    """IndexError for an id outside [0, num_embeddings): a table indexed by hand would read a padded
    row or wrap a negative id silently, which nn.Embedding never does."""
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= num_embeddings):
        raise IndexError(f"token id out of range for an embedding of {num_embeddings} rows")


class QuantEmbedding(nn.Module):
    """An embedding table kept as int8 codes and fp16 scales; looked-up rows are dequantised."""

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.scheme = qt.scheme
        self.codes = qt.codes.to(device)  # [vocab, hidden] (int4 kept one code per byte)
        self.scales = qt.scales.float().expand(qt.codes.shape[0], -1).contiguous().to(device)
        self.zeros = (
            None
            if qt.zeros is None
            else qt.zeros.float().expand(qt.codes.shape[0], -1).contiguous().to(device)
        )
        self.group_len = qt.group_len
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(input_ids, self.codes.shape[0])
        codes = self.codes[input_ids].float()  # [T, hidden]
        num_cols = codes.shape[1]
        if self.zeros is not None:
            codes = codes - self.zeros[input_ids].repeat_interleave(self.group_len, 1)[:, :num_cols]
        scales = self.scales[input_ids].repeat_interleave(self.group_len, 1)[:, :num_cols]
        return (codes * scales).to(self.dtype)


def kernel_summary(model: nn.Module) -> dict[str, int]:
    """How many quantised linears run on each kernel (e.g. {"kvq-int8-avx2": 120}), bf16 products
    included (PackedLinear: "bf16dot-avx512bf16" where vdpbf16ps runs)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[module.kernel] = counts.get(module.kernel, 0) + 1
        elif getattr(module, "bf16_products", False):  # a PackedLinear with bf16 products
            counts[module.products_kernel] = counts.get(module.products_kernel, 0) + 1
    return dict(sorted(counts.items()))
