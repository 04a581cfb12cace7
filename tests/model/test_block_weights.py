"""GGUF block weights (kvserve/model/block_weights.py) and their kernels (csrc/blocks.c,
model/block_linear.py), against ggml's own reference `gguf.quants.dequantize` (bit for bit) and an fp64
product of the dequantised weight."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from kvserve.model import block_linear, fused_decode
from kvserve.model.block_linear import BlockEmbedding, BlockLinear
from kvserve.model.block_weights import (
    SUPPORTED_TYPES,
    UnsupportedQuantizationError,
    float_tensor,
    repack,
)
from tests.gguf_tensors import TensorRecord, read_tensors

needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf 0.19 quantizes these, not the K types
WITH_BIAS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
REAL_FILES = (
    Path("/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    Path("/tmp/models/gemma-3-270m-q4_k_m.gguf"),
)
FP32_EPS = 2.0**-24  # unit roundoff


def block_len(name: str) -> int:
    return gguf.GGML_QUANT_SIZES[GT[name]][0]


def random_blocks(name: str, num_rows: int, num_cols: int, seed: int = 0) -> np.ndarray:
    """[N, bytes per row] uint8: random code bytes (every pattern is a valid block) with finite fp16
    scales (d, and dmin / m where the type has one) of a realistic size."""
    rng = np.random.default_rng(seed)
    bl, block_bytes = gguf.GGML_QUANT_SIZES[GT[name]]
    raw = rng.integers(0, 256, size=(num_rows, num_cols // bl, block_bytes), dtype=np.uint8)
    half_offsets = (208,) if name == "Q6_K" else (0, 2) if name in WITH_BIAS else (0,)
    for offset in half_offsets:
        values = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        raw[..., offset : offset + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(num_rows, -1)


def quantized_blocks(name: str, num_rows: int, num_cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return gguf.quants.quantize(
        rng.standard_normal((num_rows, num_cols)).astype(np.float32), GT[name]
    )


def assert_bits_equal(got: torch.Tensor | np.ndarray, want: np.ndarray) -> None:
    got = got.numpy() if isinstance(got, torch.Tensor) else got
    assert got.shape == want.shape
    mismatch = got.view(np.uint32) != want.astype(np.float32).view(np.uint32)
    assert not mismatch.any(), (
        f"{mismatch.sum()} values differ, first at {np.argwhere(mismatch)[0]}"
    )


def shapes_for(name: str) -> list[tuple[int, int]]:
    bl = block_len(name)
    return [(1, bl), (3, 2 * bl), (7, 320 if bl == 32 else 768)]


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_dequantize_random_blocks_bit_exact(name):
    for num_rows, num_cols in shapes_for(name):
        raw = random_blocks(name, num_rows, num_cols)
        weight = repack(raw, GT[name], (num_rows, num_cols))
        want = gguf.quants.dequantize(raw, GT[name]).reshape(num_rows, num_cols)
        assert_bits_equal(weight.dequantize(), want)
        assert weight.nibble == (name in ("Q4_0", "Q4_1", "Q4_K"))
        assert weight.bytes == sum(
            t.numel() * t.element_size()
            for t in (weight.codes, weight.scales, weight.biases)
            if t is not None
        )


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_dequantize_quantized_weights_bit_exact(name):
    raw = quantized_blocks(name, 6, 256)
    want = gguf.quants.dequantize(raw, GT[name])
    assert_bits_equal(repack(raw, name, (6, 256)).dequantize(), want)


def first_tensor_of_each_type(path: Path) -> dict[str, TensorRecord]:
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    seen: dict[str, TensorRecord] = {}
    for tensor in read_tensors(path):
        seen.setdefault(tensor.ggml_type.name, tensor)
    return seen


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_real_file_tensors_bit_exact(path):
    tensors = first_tensor_of_each_type(path)
    assert len([name for name in tensors if name in SUPPORTED_TYPES]) >= 2
    for type_name, tensor in tensors.items():
        shape = tensor.torch_shape  # ggml [K, N] -> torch [N, K]
        if type_name in FLOAT_TYPE_NAMES:
            got = float_tensor(tensor.data, tensor.ggml_type, shape)
            assert_bits_equal(got, np.asarray(tensor.data).view(np.float32).reshape(shape))
            continue
        raw = tensor.data[:256]  # whole rows (the tensors are memmapped: only these are read)
        weight = repack(raw, tensor.ggml_type, (raw.shape[0], shape[1]))
        want = gguf.quants.dequantize(raw, tensor.ggml_type).reshape(raw.shape[0], shape[1])
        assert_bits_equal(weight.dequantize(), want)


FLOAT_TYPE_NAMES = ("F32", "F16", "BF16")


def test_float_tensor_types():
    values = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    assert_bits_equal(float_tensor(values, GT.F32, (3, 4)), values)
    half = values.astype(np.float16)
    assert_bits_equal(float_tensor(half, "F16", (3, 4)), half.astype(np.float32))
    bf16 = torch.from_numpy(values).bfloat16()
    raw = bf16.view(torch.int16).numpy().view(np.uint8)
    assert torch.equal(float_tensor(raw, "BF16", (3, 4)), bf16.float())


def test_unsupported_type_is_a_typed_error():
    with pytest.raises(UnsupportedQuantizationError, match="Q2_K.*Q4_K") as caught:
        repack(np.zeros((1, 84), np.uint8), GT.Q2_K, (1, 256))
    assert isinstance(caught.value, ValueError) and caught.value.ggml_type == "Q2_K"
    with pytest.raises(UnsupportedQuantizationError, match="IQ2_XXS"):
        repack(np.zeros(66, np.uint8), "IQ2_XXS", (1, 256))
    with pytest.raises(UnsupportedQuantizationError, match="Q4_0"):
        float_tensor(np.zeros(18, np.uint8), "Q4_0", (1, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        repack(np.zeros(144, np.uint8), "Q4_K", (1, 288))
    with pytest.raises(ValueError, match="bytes"):
        repack(np.zeros(17, np.uint8), "Q4_0", (1, 32))


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q6_K"])
def test_select_rows_and_dequantize_rows(name):
    num_rows, num_cols = 9, 2 * block_len(name)
    weight = repack(random_blocks(name, num_rows, num_cols), name, (num_rows, num_cols))
    full = weight.dequantize()
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weight.select_rows(perm).dequantize(), full[perm])
    assert weight.select_rows(perm[:4]).shape == (4, num_cols)
    ids = torch.tensor([3, 3, 0, 8])
    assert torch.equal(weight.dequantize_rows(ids), full[ids])


# --- kernels -----------------------------------------------------------------------------------------


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    if not block_linear.native_available():
        pytest.skip("the C kernel library did not build")
    if request.param not in fused_decode.available_isas():
        pytest.skip(f"this CPU (or build) has no {request.param}")
    fused_decode.set_max_isa(request.param)
    yield request.param
    fused_decode.reset_isa()


def error_bound(weight, x: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on |kernel - x @ W^T| (W the exact dequantised weight, the oracle in fp64).

    The kernel computes sum_k x_k * fl(s_g c_k) + sum_g b_g * fl(sum_{k in g} x_k): each weight is one
    rounding from s_g c_k, and the products and the additions of at most K + G + 2 terms each add one
    rounding, so every term's relative error is at most (K + G + 4) u (first order, u = 2^-24) and the
    total at most (K + G + 4) u * sum_k |x_k| (|s_g c_k| + |b_g|). The exact W = fl(s c + b) differs from
    s c + b by u |W| <= u (|s c| + |b|) per weight, inside the same sum. Factor 2 for second-order terms."""
    scaled = (weight.code_values().double().view(weight.num_rows, weight.num_groups, -1)
              * weight.scales.double().unsqueeze(2)).abs()  # fmt: skip
    if weight.biases is not None:
        scaled = scaled + weight.biases.double().abs().unsqueeze(2)
    magnitude = x.double().abs() @ scaled.view(weight.num_rows, -1).T  # [M, N]
    return 2 * (weight.num_cols + weight.num_groups + 4) * FP32_EPS * magnitude


KERNEL_ROWS = (1, 2, 3, 5, 8, 17, 64)


def kernel_cases(name: str) -> list[int]:
    return [256, 320] if block_len(name) == 32 else [256, 512]


@needs_kernel
@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_block_linear_against_fp64(name, isa):
    for num_cols in kernel_cases(name):
        num_rows = 21  # not a multiple of the kernel's 16-row chunks
        weight = repack(
            random_blocks(name, num_rows, num_cols, seed=num_cols), name, (num_rows, num_cols)
        )
        assert weight.group_len == (16 if name == "Q6_K" else 32)
        assert (weight.biases is not None) == (name in WITH_BIAS)
        exact = weight.dequantize().double()
        for num_tokens in KERNEL_ROWS:
            x = torch.randn(
                num_tokens, num_cols, generator=torch.Generator().manual_seed(num_tokens)
            )
            y = torch.full((num_tokens, num_rows), float("nan"))
            block_linear.linear_into(weight, x, y)
            err = (y.double() - x.double() @ exact.T).abs()
            bound = error_bound(weight, x)
            assert (err <= bound).all(), (
                f"M={num_tokens} K={num_cols}: {(err / bound).max():.3g}x bound"
            )


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_block_linear_row_does_not_depend_on_the_batch(name, isa):
    """A row's result is the same bits alone or in a tile of up to 8 rows (the kernel's tiles of
    1, 2, 3.. rows sum each group in the same order): a request's output must not depend on what else
    is in the batch. Below the 16 rows where the dequantise-and-GEMM path takes over."""
    weight = repack(random_blocks(name, 24, 256, seed=3), name, (24, 256))
    x = torch.randn(15, 256, generator=torch.Generator().manual_seed(5))
    full = torch.empty(15, 24)
    block_linear.linear_into(weight, x, full)
    for m in range(1, 15):
        part = torch.empty(m, 24)
        block_linear.linear_into(weight, x[15 - m :], part)
        assert torch.equal(part, full[15 - m :]), m


@needs_kernel
@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_native_dequant_rows_bit_exact(name, isa):
    num_rows, num_cols = 11, 2 * block_len(name)
    raw = random_blocks(name, num_rows, num_cols, seed=3)
    weight = repack(raw, name, (num_rows, num_cols))
    want = gguf.quants.dequantize(raw, GT[name]).reshape(num_rows, num_cols)
    assert_bits_equal(block_linear.dequantize_rows_native(weight, None, 0, num_rows), want)
    assert_bits_equal(block_linear.dequantize_rows_native(weight, None, 4, 3), want[4:7])
    ids = torch.tensor([10, 0, 10, 5])
    assert_bits_equal(block_linear.dequantize_rows_native(weight, ids, 0, 4), want[ids.numpy()])


def fused_qkv() -> tuple[list, torch.Tensor]:
    """Gemma-like q, k (Q5_0) and v (Q8_0), 256 inputs, and an output bias."""
    parts = [
        repack(quantized_blocks(t, rows, 256, seed=i), t, (rows, 256))
        for i, (t, rows) in enumerate((("Q5_0", 40), ("Q5_0", 24), ("Q8_0", 24)))
    ]
    return parts, torch.randn(88, generator=torch.Generator().manual_seed(5))


def fused_reference(parts, bias, x):
    weight = torch.cat([p.dequantize() for p in parts]).double()
    return x.double() @ weight.T + bias.double()


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fused_block_linear_both_paths(num_tokens, isa):
    parts, bias = fused_qkv()
    layer = BlockLinear(parts, bias, dequant_min_rows=32)
    assert layer.kernel == f"blocks-{isa}" and layer.out_features == 88
    x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(7))
    y = layer(x)
    want = fused_reference(parts, bias, x)
    bounds = (
        torch.cat([error_bound(p, x) for p in parts], dim=1) + 4 * FP32_EPS * bias.abs().double()
    )
    assert ((y.double() - want).abs() <= bounds).all()


def test_block_linear_without_library(monkeypatch):
    monkeypatch.setattr(block_linear, "native_available", lambda: False)
    parts, bias = fused_qkv()
    layer = BlockLinear(parts, bias)
    assert layer.kernel == "dequantized"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    want = fused_reference(parts, bias, x)
    assert (layer(x).double() - want).abs().max() < 1e-3


@needs_kernel
def test_embedding_lookup_and_tied_head(isa):
    num_rows, num_cols = 50, 64
    raw = quantized_blocks("Q8_0", num_rows, num_cols, seed=9)
    table = repack(raw, "Q8_0", (num_rows, num_cols))
    embedding = BlockEmbedding(table)
    ids = torch.tensor([[3, 49], [0, 3]])
    want = gguf.quants.dequantize(raw, GT.Q8_0).reshape(num_rows, num_cols)[ids.numpy()]
    assert_bits_equal(embedding(ids), want)
    with pytest.raises(IndexError):
        embedding(torch.tensor([50]))
    head = embedding.tied_head()
    assert head.parts[0] is table and head.parts[0].codes.data_ptr() == table.codes.data_ptr()
    x = torch.randn(2, num_cols, generator=torch.Generator().manual_seed(10))
    err = (head(x).double() - x.double() @ table.dequantize().double().T).abs()
    assert (err <= error_bound(table, x)).all()
