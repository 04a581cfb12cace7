"""Quantised linear layers and embedding tables (docs/quantization.md).

`QuantLinear` keeps the weight as packed integer codes and runs kvserve's integer GEMM extension
(kvserve/quant/csrc/qgemm.cpp: activations rounded to int8, integer dot products per 32 inputs). Where
that cannot run (the extension did not build, or an accelerator), it multiplies by the dequantised
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
from kvserve.quant.scheme import ACT_TENSOR, ACT_TOKEN, KERNEL_BLOCK, TensorScheme

logger = logging.getLogger(__name__)
_ACT_MODES = {"block": 0, ACT_TOKEN: 1, ACT_TENSOR: 2}


def round_activations(x: torch.Tensor, act: str) -> torch.Tensor:
    """x [M, K] fp32 -> the values the kernel multiplies: int8 codes times their scale, one scale per
    32 inputs of a row ("block"), per row ("token") or for all of x ("tensor"). Same arithmetic as the
    C++ kernel (fp32 scale = absmax / 127, round half to even)."""
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
        if device.type == "cpu" and kernels_available():
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
            # a few rows (decode): the native GEMV of model/fused_decode.py, the same arithmetic
            # without the op's per-call setup
            self.small_rows = fused_decode.max_rows()
            self._keep: list = []
            self._desc = fused_decode.linear_descriptor(self, self._keep)
        else:
            self.kernel = "dequantized-fp32" if device.type == "cpu" else f"dequantized-{device}"
            self.weight_deq = qt.dequantize().to(device)  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]; the op takes any strides and float dtype (one call: decode runs
        # ~120 of these per token, so Python work here costs as much as the matmul)
        if self.weight_deq is None:
            if x.dim() == 2 and 0 < x.shape[0] <= self.small_rows and x.dtype == torch.float32:
                return fused_decode.small_linear(self._desc, x)  # [M, in] -> [M, out]
            return self._op(x, *self._args)
        x2 = x.reshape(-1, self.in_features).float()
        y = F.linear(round_activations(x2, self.scheme.act), self.weight_deq, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.scheme.name}, {self.kernel}"


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
        codes = self.codes[input_ids].float()  # [T, hidden]
        num_cols = codes.shape[1]
        if self.zeros is not None:
            codes = codes - self.zeros[input_ids].repeat_interleave(self.group_len, 1)[:, :num_cols]
        scales = self.scales[input_ids].repeat_interleave(self.group_len, 1)[:, :num_cols]
        return (codes * scales).to(self.dtype)


def kernel_summary(model: nn.Module) -> dict[str, int]:
    """How many quantised linears run on each kernel (e.g. {"kvq-int8-avx2": 120})."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[module.kernel] = counts.get(module.kernel, 0) + 1
    return dict(sorted(counts.items()))
