"""Linear layers and embedding tables over GGUF block weights (model/block_weights.py), fp32 activations.

`BlockLinear` stacks one or more `BlockWeight` parts along its outputs (a fused q/k/v may mix types:
Gemma 3's q and k are Q5_0, its v Q8_0). Per call it picks:
  - few rows (decode): the native kernel, csrc/blocks.c `block_linear`, each part writing its column
    slice of one output (`kernel` "blocks-avx2" / "blocks-scalar");
  - many rows (prefill): chunks of weight rows dequantised to fp32 (csrc/blocks.c
    `block_dequant_rows`) and multiplied by torch.matmul (MKL/oneDNN), which wins once the product is
    compute bound. Where the two meet comes from the table measured at load (`row_kernels`,
    model/kernel_table.py); without one, the fixed rule T >= DEQUANT_MIN_ROWS;
  - no C library: the same chunked dequantise-and-matmul in torch (`kernel` "dequantized").
`BlockEmbedding` looks rows up without dequantising the table; a tied head is a `BlockLinear` over the
embedding's own `BlockWeight` (no second copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvserve.model import cpu_kernels, fused_decode
from kvserve.model.block_weights import BlockWeight
from kvserve.model.kernel_choice import bucket_index

# Rows from which dequantise + torch.matmul beats the native kernel. Measured (benchmarks/block_linear.py,
# benchmarks/results/zen3_avx2/gguf_blocks_threads1.json; AMD Zen 3, AVX2, 1 thread, load average 0.5,
# median of 5 alternated rounds), kernel vs dequantise + matmul in ms:
#   Q4_1 576x1536   M=4 0.37 vs 0.47   M=16 1.26 vs 0.76
#   Q4_1 1536x576   M=4 0.55 vs 0.64   M=16 1.67 vs 0.92
#   Q8_0 49152x576  M=4 11.3 vs 20.1   M=16 34.3 vs 25.1
# M between 4 and 16 is not measured yet; 16 is the smallest measured row count where the matmul wins.
DEQUANT_MIN_ROWS = 16
DEQUANT_CHUNK_BYTES = 4 << 20  # fp32 weight rows dequantised per matmul (fits L2+L3 comfortably)


class BlockKernelError(RuntimeError):
    """The native block kernel refused its arguments (a bug: shapes are checked before the call)."""


def _library():
    return cpu_kernels.load_kernel()


def native_available() -> bool:
    library = _library()
    return library is not None and getattr(library, "block_linear", None) is not None


def _check_status(status: int, what: str) -> None:
    if status != 0:
        raise BlockKernelError(f"{what} failed with status {status}")


def linear_into(
    weight: BlockWeight,
    x: torch.Tensor,  # [M, K] fp32, unit column stride
    y: torch.Tensor,  # [M, N] fp32 view, unit column stride (a column slice of a wider output is fine)
    out_bias: torch.Tensor | None = None,  # [N] fp32
) -> None:
    """y = x @ W^T (+ out_bias) by the native kernel."""
    num_rows, num_cols = x.shape
    if num_cols != weight.num_cols or y.shape != (num_rows, weight.num_rows):
        raise ValueError(f"x {tuple(x.shape)}, y {tuple(y.shape)} do not fit weight {weight.shape}")
    if x.stride(1) != 1 or y.stride(1) != 1 or x.dtype != torch.float32 or y.dtype != torch.float32:
        raise ValueError("block_linear needs fp32 x and y with unit column stride")
    status = _library().block_linear(
        x.data_ptr(),
        x.stride(0),
        num_rows,
        num_cols,
        weight.codes.data_ptr(),
        int(weight.nibble),
        weight.code_offset,
        weight.scales.data_ptr(),
        None if weight.biases is None else weight.biases.data_ptr(),
        weight.group_len,
        weight.num_rows,
        None if out_bias is None else out_bias.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        torch.get_num_threads(),
    )
    _check_status(status, "block_linear")


def dequantize_rows_native(
    weight: BlockWeight, row_ids: torch.Tensor | None, row0: int, num_rows: int
) -> torch.Tensor:
    """[num_rows, K] fp32: rows `row_ids` (int64), or row0 .. row0 + num_rows - 1 when None; bit for bit
    BlockWeight.dequantize."""
    out = torch.empty(num_rows, weight.num_cols)
    ids = None if row_ids is None else row_ids.to(torch.int64).contiguous()
    status = _library().block_dequant_rows(
        weight.codes.data_ptr(),
        int(weight.nibble),
        weight.code_offset,
        weight.scales.data_ptr(),
        None if weight.biases is None else weight.biases.data_ptr(),
        weight.group_len,
        weight.num_cols,
        None if ids is None else ids.data_ptr(),
        row0,
        num_rows,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    _check_status(status, "block_dequant_rows")
    return out


def _dequantize_range(weight: BlockWeight, row0: int, row1: int, native: bool) -> torch.Tensor:
    if native:
        return dequantize_rows_native(weight, None, row0, row1 - row0)
    return weight.select_rows(torch.arange(row0, row1)).dequantize()


def dequant_matmul_into(
    weight: BlockWeight, x: torch.Tensor, y: torch.Tensor, native: bool
) -> None:
    """y = x @ W^T, W dequantised DEQUANT_CHUNK_BYTES of rows at a time ([M, K] x and [M, N] y)."""
    chunk_rows = max(16, DEQUANT_CHUNK_BYTES // (4 * weight.num_cols))
    for row0 in range(0, weight.num_rows, chunk_rows):
        row1 = min(row0 + chunk_rows, weight.num_rows)
        y[:, row0:row1] = torch.matmul(x, _dequantize_range(weight, row0, row1, native).t())


class BlockLinear(nn.Module):
    """y = x @ [W_0; W_1; ...]^T (+ bias) over GGUF block weights (CPU, fp32 activations). The parts are
    held as given: a part shared with a BlockEmbedding (a tied head) is not copied."""

    def __init__(
        self,
        parts: Sequence[BlockWeight],
        bias: torch.Tensor | None = None,  # [sum of the parts' rows] fp32
        dequant_min_rows: int = DEQUANT_MIN_ROWS,
    ) -> None:
        super().__init__()
        if not parts:
            raise ValueError("BlockLinear needs at least one weight part")
        in_features = {p.num_cols for p in parts}
        if len(in_features) != 1:
            raise ValueError(f"the parts' column counts differ: {sorted(in_features)}")
        self.parts = tuple(parts)
        self.in_features = in_features.pop()
        self.out_features = sum(p.num_rows for p in parts)
        self.part_offsets = [sum(p.num_rows for p in parts[:i]) for i in range(len(parts) + 1)]
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)} does not match {self.out_features} outputs")
        self.bias = None if bias is None else bias.float().contiguous()
        self.dequant_min_rows = dequant_min_rows
        # per row bucket (model/kernel_table.py): True the block kernel, False dequantise + matmul,
        # None the fixed rule above; None for no table (`--kernel-choice own`)
        self.row_kernels: tuple[bool | None, ...] | None = None

    @property
    def kernel(self) -> str:
        """What runs small batches: "blocks-avx2", "blocks-scalar" or "dequantized" (no C library)."""
        return f"blocks-{fused_decode.isa()}" if native_available() else "dequantized"

    @property
    def weight_bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.numel() // self.in_features
        use_kernel = None
        if self.row_kernels is not None:
            use_kernel = self.row_kernels[bucket_index(num_rows)]
        if use_kernel is None:
            use_kernel = num_rows < self.dequant_min_rows
        return self.forward_rule(x, use_kernel)

    def forward_rule(self, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
        """y for `x` [..., in] on the block kernel (`use_kernel`, where it builds) or by dequantising
        chunks of rows for torch.matmul."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # [T, K]
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = x2.new_empty(x2.shape[0], self.out_features)  # [T, N]
        native = native_available()
        use_kernel = native and use_kernel
        for part, row0, row1 in zip(
            self.parts, self.part_offsets, self.part_offsets[1:], strict=False
        ):
            out = y[:, row0:row1]
            if use_kernel:
                bias = None if self.bias is None else self.bias[row0:row1]
                linear_into(part, x2, out, bias)
            else:
                dequant_matmul_into(part, x2, out, native)
        if self.bias is not None and not use_kernel:
            y += self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        types = ",".join(p.ggml_type for p in self.parts)
        return f"{self.in_features} -> {self.out_features}, {types}, {self.kernel}"


class BlockEmbedding(nn.Module):
    """ids -> rows of a GGUF block table (e.g. Q8_0 or Q6_K token embeddings), dequantised per lookup."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)  # [num_ids]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings})")
        if native_available():
            rows = dequantize_rows_native(self.weight, flat, 0, flat.numel())
        else:
            rows = self.weight.dequantize_rows(flat)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def tied_head(self) -> BlockLinear:
        """The output projection that shares this table (no copy)."""
        return BlockLinear([self.weight])
