"""The fused decode step and the small-row GEMVs (model/fused_decode.py, csrc/decode_step.c): against an
fp64 product, against the quantised GEMM extension, against the per-op path and a one-pass recompute
through the torch backend; that the fast path is taken; the scalar fallback; no compiler."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model import cpu_kernels, fused_decode
from kvserve.model.kv_cache import allocate_layers, quantise
from kvserve.model.linear import PackedLinear, onednn_available
from kvserve.model.qlinear import QuantLinear, round_activations
from kvserve.quant.kernels import kernels_available
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import parse_tensor_scheme
from tests import REPO_ROOT
from tests.oracle import assert_logits_close

needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(40)]
QUANT_FORMATS = ["int8", "int4-g32", "int4-g128-zp", "int4", "w8a8", "w8a8-pt", "int8-g128"]


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    if request.param not in fused_decode.available_isas():
        pytest.skip(f"this CPU (or build) has no {request.param}")
    fused_decode.set_max_isa(request.param)
    yield request.param
    fused_decode.reset_isa()


@needs_kernel
@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_small_linear_equals_fp64_product(isa, bias):
    gen = torch.Generator().manual_seed(0)
    # K = 77: not a multiple of the 8-wide vectors; N = 37: not a multiple of any column tile
    for n, k in [(37, 77), (96, 64)]:
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        linear = PackedLinear(w, b)
        for m in range(1, fused_decode.max_rows() + 1):
            x = torch.randn(m, k, generator=gen)
            expected = x.double() @ w.double().T + (0 if b is None else b.double())
            torch.testing.assert_close(linear(x).double(), expected, atol=1e-5, rtol=1e-5)
        x = torch.randn(3, 40, k, generator=gen)  # a prefill: 120 rows, 3-D, the same GEMM
        torch.testing.assert_close(linear(x).double(), x.double() @ w.double().T +
                                   (0 if b is None else b.double()), atol=1e-4, rtol=1e-4)  # fmt: skip


@needs_kernel
def test_fp32_packed_linear_runs_the_panel_gemm_at_every_row_count_and_keeps_no_onednn_copy(isa):
    """With AVX2, PackedLinear takes the panel GEMM for decode and prefill alike (it measured at
    least as fast as oneDNN from 16 to 2048 rows, docs/performance.md), so it holds the panels only.
    On the portable loops (~40x slower than oneDNN at prefill sizes) the panels take the decode
    rows and oneDNN's copy the rest."""
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(50, 96, generator=gen), torch.randn(50, generator=gen)
    linear = PackedLinear(w, b)
    assert linear.panels is not None
    assert (linear.packed is None) == (isa != "scalar")
    for shape in [(1, 96), (4, 96), (17, 96), (2, 300, 96), (0, 96)]:
        x = torch.randn(*shape, generator=gen)
        got = linear(x)
        assert got.shape == (*shape[:-1], 50)
        panel = fused_decode.small_linear(linear._desc, x.reshape(-1, 96)).reshape(got.shape)
        if isa != "scalar" or (len(shape) == 2 and shape[0] <= fused_decode.max_rows()):
            assert torch.equal(got, panel)
        else:  # oneDNN
            torch.testing.assert_close(got, panel, atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_panels_equal_fp64_product_and_scalar_bits(isa, bias):
    """The fp32 panel GEMV / GEMM (csrc/decode_step.c) against an fp64 product within the bound of
    recursive summation, for N not a multiple of the 16-column panel (1, 37, 50) and odd K (1, 77,
    129), 1-4 rows (one tile) and 5, 7, 16, 40 rows (row tiles of 6 and their remainders), 13 panels
    (200: the AVX-512 tiles of 4, 2 and 1 panels side by side) and 64 (1016: the AVX2 few-row
    tiles' groups of 4 and pairs, the partial last panel inside the last group on one thread; on two
    threads, inside whichever chunk claims it); and the scalar path gives the same bits as the vector
    ones (one fmaf per input, in order, then the bias)."""
    gen = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    try:
        for (n, k), num_threads in product(
            [(1, 1), (37, 77), (50, 129), (64, 576), (200, 33), (1016, 65)], [1, 2]
        ):
            torch.set_num_threads(num_threads)
            w = torch.randn(n, k, generator=gen)
            b = torch.randn(n, generator=gen) if bias else None
            linear = PackedLinear(w, b)
            assert linear.panels.shape == (-(-n // 16), k, 16)
            for m in [*range(1, fused_decode.max_rows() + 1), 5, 7, 16, 40]:
                x = torch.randn(m, k, generator=gen)
                expected = x.double() @ w.double().T + (0 if b is None else b.double())
                got = fused_decode.small_linear(linear._desc, x)
                # beyond max_rows on the scalar ISA the module runs oneDNN
                if isa != "scalar" or m <= fused_decode.max_rows():
                    assert torch.equal(linear(x), got)  # the module runs this GEMM at any row count
                # recursive summation: |error| <= K u sum |x w| (+ the bias add's rounding), u = 2^-24
                sum_abs = x.double().abs() @ w.double().abs().T + expected.abs()
                bound = (k + 1) * 2.0**-24 * sum_abs
                error = (got.double() - expected).abs()
                assert (error <= bound + 1e-12).all(), f"{n}x{k}, {m} rows"
                fused_decode.set_max_isa("scalar")
                scalar = fused_decode.small_linear(linear._desc, x)
                fused_decode.set_max_isa(isa)
                assert torch.equal(got, scalar), f"{n}x{k}, {m} rows: {isa} and scalar differ"
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_fp32_panel_layout_puts_each_weight_where_the_header_says():
    w = torch.randn(21, 5)
    panels = fused_decode.f32_panels(w)  # [P, K, 16]: panels[p, k, c] = W[16p + c, k]
    assert panels.shape == (2, 5, 16) and panels.is_contiguous()
    for col, inp in [(0, 0), (15, 4), (16, 2), (20, 3)]:
        assert panels[col // 16, inp, col % 16] == w[col, inp]
    assert torch.count_nonzero(panels[1, :, 5:]) == 0  # columns 21-31: padding


@needs_kernel
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("n, k", [(45, 200), (37, 77), (64, 576)])
def test_quantised_gemv_equals_the_dequantised_reference(isa, fmt, n, k):
    """The panel-layout GEMV / GEMM (csrc/qgemv.c) equals the dequantised weight times the
    kernel-rounded activations to 1e-5 of the output's scale (only fp32 summation order differs),
    for 1-4 rows and beyond (5, 17: row tiles), K not a multiple of 32 or of the group (200, 77),
    N not a multiple of the 8-column panel (45, 37), with and without bias; and the forced scalar
    path gives the same bits as the AVX2 one (the same integers and fp32 operations in order)."""
    gen = torch.Generator().manual_seed(n * k)
    scheme = parse_tensor_scheme(fmt)
    weight = torch.randn(n, k, generator=gen)
    qt = quantize(weight, scheme)
    reference_weight = qt.dequantize()
    for bias in (None, torch.randn(n, generator=gen)):
        linear = QuantLinear(qt, bias)
        assert linear.layout == "panel" and linear.kernel == f"kvq-int{scheme.bits}-{isa}"
        for m in [*range(1, fused_decode.max_rows() + 1), 5, 17]:
            x = torch.randn(m, k, generator=gen) * 3
            got = linear(x)
            expected = round_activations(x, scheme.act) @ reference_weight.T
            expected = expected + (0 if bias is None else bias)
            scale = expected.abs().max()
            assert (got - expected).abs().max() <= 1e-5 * scale, f"{fmt}, {m} rows"
            fused_decode.set_max_isa("scalar")
            scalar = linear(x)
            fused_decode.set_max_isa(isa)
            assert torch.equal(got, scalar), f"{fmt}, {m} rows: {isa} and scalar differ"


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g128-zp"])
def test_block2_activations_add_the_remainders_rounding(isa, fmt):
    """act "block2" (--gguf-activations int8x2, csrc/qgemv.c ACT_BLOCK2): each row is rounded per 32
    inputs, then the remainder with its own scale, two rows of codes whose products store_panel adds.
    The GEMV equals the dequantised weight times round_activations(x, "block2") to 1e-5 of the
    output's scale at 1-5 and 17 rows (pairs of rounded rows across the row tiles of 4), the scalar
    path gives the ISA's bits, and against the exact product x W^T its error is under 1/50 of one
    rounding's ("block"), an outlier input included (what makes one rounding coarse)."""
    from dataclasses import replace

    from kvserve.quant.scheme import ACT_BLOCK2

    gen = torch.Generator().manual_seed(7)
    scheme = replace(parse_tensor_scheme(fmt), act=ACT_BLOCK2)
    qt = quantize(torch.randn(45, 200, generator=gen), scheme)
    weight, bias = qt.dequantize(), torch.randn(45, generator=gen)
    twice = QuantLinear(qt, bias)
    once = QuantLinear(replace(qt, scheme=replace(scheme, act="block")), bias)
    assert twice.act_mode == 3 and twice.layout == "panel"
    for m in (1, 2, 3, 4, 5, 17):
        x = torch.randn(m, 200, generator=gen) * 3
        x[:, 7] = 40.0
        got = twice(x)
        expected = round_activations(x, ACT_BLOCK2) @ weight.T + bias
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), f"{fmt}, {m} rows"
        fused_decode.set_max_isa("scalar")
        scalar = twice(x)
        fused_decode.set_max_isa(isa)
        assert torch.equal(got, scalar), f"{fmt}, {m} rows: {isa} and scalar differ"
        exact = x.double() @ weight.double().T + bias.double()
        error_twice = (got.double() - exact).abs().max()
        error_once = (once(x).double() - exact).abs().max()
        assert error_twice * 50 <= error_once, (fmt, m, error_twice, error_once)


@needs_kernel
@pytest.mark.skipif(not kernels_available(), reason="the quantised GEMM extension did not build")
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g128-zp", "w8a8"])
def test_quantised_gemv_equals_the_gemm_extension(fmt):
    """The torch extension (kvserve/quant/csrc/qgemm.cpp, its row layout: the path without the C
    library) and the panel GEMV compute the same function: 1e-5 of the output's scale."""
    from kvserve.model.qlinear import pack_for_kernel

    gen = torch.Generator().manual_seed(3)
    scheme = parse_tensor_scheme(fmt)
    qt = quantize(torch.randn(45, 200, generator=gen), scheme)
    bias = torch.randn(45, generator=gen)
    linear = QuantLinear(qt, bias)
    rows = pack_for_kernel(qt)
    for m in (1, 3, 9):
        x = torch.randn(m, 200, generator=gen)
        if scheme.bits == 8:
            extension = torch.ops.kvq.q8_linear(x, rows["w"], rows["scales"], rows["bpg"], bias,
                                                linear.act_mode)  # fmt: skip
        else:
            extension = torch.ops.kvq.q4_linear(x, rows["w"], rows["scales"], rows["zeros"],
                                                rows["bpg"], bias, linear.act_mode)  # fmt: skip
        got = linear(x)
        assert (got - extension).abs().max() <= 1e-5 * extension.abs().max(), f"{fmt}, {m} rows"


@needs_kernel
def test_panel_layout_puts_each_code_where_the_header_says(isa):
    """pack_panels against the index formula of csrc/decode_step.h, and an int8 code of -128 (|w| is
    the unsigned operand: 128, one past int8) computed exactly."""
    from kvserve.model.qlinear import pack_panels
    from kvserve.quant.rtn import QuantizedTensor

    gen = torch.Generator().manual_seed(4)
    n, k = 11, 70
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[3, 5] = -128
    scales = torch.rand(n, 1, generator=gen).half() + 0.5
    qt = QuantizedTensor(parse_tensor_scheme("int8"), codes, scales, None)
    packed = pack_panels(qt)
    assert packed["w"].shape == (2, 3, 8, 8, 4)
    for col, inp in [(0, 0), (3, 5), (10, 69), (7, 33)]:
        p, c, b, j, t = col // 8, col % 8, inp // 32, (inp % 32) // 4, inp % 4
        assert packed["w"][p, b, j, c, t] == codes[col, inp]
    assert packed["w"][1, 2, 7, 7, 3] == 0  # padding: column 15, input 95
    x = torch.randn(2, k, generator=gen)
    expected = round_activations(x, "block") @ qt.dequantize().T
    got = QuantLinear(qt, None)(x)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    int4 = quantize(torch.randn(n, k, generator=gen), parse_tensor_scheme("int4-g32"))
    nibbles = pack_panels(int4)["w"]  # [P, nb, 4, 8, 4]
    unsigned = (int4.codes.to(torch.int16) + 8).to(torch.uint8)
    for col, inp in [(0, 0), (9, 17), (10, 69), (4, 47)]:
        p, c, b, r = col // 8, col % 8, inp // 32, inp % 32
        byte = int(nibbles[p, b, (r % 16) // 4, c, r % 4])
        assert (byte >> 4 if r >= 16 else byte & 0x0F) == unsigned[col, inp]


def _fused_and_per_op(model_dir: Path, **options) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token-by-token logits with the fused step, the same with it off, and the fused steps run."""
    llm = LLM(str(model_dir), num_blocks=64, **options)
    model = llm.engine.runner.model
    fused = llm.engine.score(PROMPT, chunk_size=1)  # every position is a decode row
    assert model.fused is not None, "the fused decode step was not built"
    steps = model.fused.num_steps
    model.fused_decode, model.fused = False, None
    per_op = llm.engine.score(PROMPT, chunk_size=1)
    assert model.fused is None
    return fused, per_op, steps


@needs_kernel
@pytest.mark.parametrize(
    "quantization", [None, "int8", "int4-g32", "linear=int8,head=int8", "linear=int8,embed=int8"]
)
def test_fused_step_is_taken_and_equals_the_per_op_path(llama_dir, isa, quantization):
    if quantization and not kernels_available():
        pytest.skip("the quantised GEMM extension did not build")
    fused, per_op, steps = _fused_and_per_op(llama_dir, quantization=quantization)
    assert steps == len(PROMPT)
    # the same C functions in the same order (the per-op path's linears run the same GEMVs)
    assert torch.equal(fused, per_op)


@needs_kernel
@pytest.mark.parametrize(
    "arch, quantization, kind",
    [("llama_tied", None, 2), ("llama", None, 1), ("llama_tied", "linear=int8,head=int8", 1),
     ("llama", "linear=int8,embed=int8", 0)],
)  # fmt: skip
def test_the_fused_step_looks_up_its_embedding_and_rope_rows_in_c(
    checkpoints, arch, quantization, kind
):
    """The fused step takes token ids and positions (csrc/decode_step.c decode_step_tokens): the rows
    of a tied head's fp32 panels (kind 2) or of an fp32 table (kind 1) are read in C, a quantised
    table (kind 0) looks its rows up itself; each gives the per-op path's logits bit for bit. An id
    outside the table (any kind) or a position outside the RoPE table is an IndexError before
    anything is written."""
    if quantization and not kernels_available():
        pytest.skip("the quantised GEMM extension did not build")
    fused_logits, per_op, steps = _fused_and_per_op(checkpoints[arch][0], quantization=quantization)
    assert steps == len(PROMPT) and torch.equal(fused_logits, per_op)
    llm = LLM(str(checkpoints[arch][0]), num_blocks=64, quantization=quantization)
    model = llm.engine.runner.model
    llm.engine.score(PROMPT, chunk_size=1)
    fused = model.fused
    assert fused is not None and fused_decode.embedding_table(model.embed_tokens)[0] == kind
    caches = llm.engine.runner.kv_caches
    assert fused.matches(caches) and fused.matches(list(caches))  # a copy of the list: by tensors
    assert not fused.matches(caches[1:] + caches[:1])
    vocab, positions = model.config.vocab_size, fused.cos.shape[0]
    steps = fused.num_steps
    kv = [(c.k.clone(), c.v.clone()) for c in caches]
    # one row at slot 0 (block 0), which the refused calls would otherwise have written
    meta = (
        torch.tensor([0]),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
    )
    for bad in (vocab, -1):  # kind 0: the quantised table's own lookup refuses it (qlinear.py)
        with pytest.raises(IndexError, match=f"embedding of {vocab} rows"):
            fused(torch.tensor([bad]), torch.tensor([0]), model.embed_tokens, *meta)
    for bad in (positions, -1):
        with pytest.raises(IndexError, match=f"RoPE table of {positions} rows"):
            fused(torch.tensor([3]), torch.tensor([bad]), model.embed_tokens, *meta)
    assert fused.num_steps == steps
    assert all(
        torch.equal(c.k, k) and torch.equal(c.v, v) for c, (k, v) in zip(caches, kv, strict=True)
    )


@needs_kernel
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_8bit_kv_writer_gives_kv_cache_quantises_bits(kind):
    """csrc/layer_ops.c write_kv_q (the fused step's and the CPU per-op path's writer) against
    kv_cache.quantise (torch): codes and fp16 scales bit for bit, over vectors from 1e-30 (fp16
    subnormal and clamped scales) to 1e6, an all-zero and an all-negative-zero vector, heads not
    contiguous with the row (q in front, as in the fused projection), slots in any order."""
    gen = torch.Generator().manual_seed(0)
    rows, heads, dim = 64, 3, 64
    _, (cache,) = allocate_layers(1, 8, 16, heads, dim, torch.float32, kind, torch.device("cpu"))
    qkv = torch.randn(rows, (4 + 2 * heads) * dim, generator=gen)
    qkv *= torch.logspace(-30, 6, rows)[:, None]
    qkv[3], qkv[5] = 0.0, -0.0
    qkv[7, 4 * dim : 4 * dim + 5] = 448.0 * torch.tensor([1.0, -1.0, 0.5, 0.25, 1e-3])
    k = qkv[:, 4 * dim : (4 + heads) * dim].view(rows, heads, dim)
    v = qkv[:, (4 + heads) * dim :].view(rows, heads, dim)
    slots = torch.randperm(128, generator=gen)[:rows]
    cpu_kernels.write_kv_q(k, v, slots, cache)
    for x, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        want_codes, want_scales = quantise(x, kind)
        assert torch.equal(codes.view(-1, heads, dim)[slots], want_codes)
        got = scales.view(-1, heads)[slots]
        assert torch.equal(got.view(torch.int16), want_scales.view(torch.int16))
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[slots] = False
    assert (cache.k.view(-1, heads, dim)[untouched] == 0).all()  # only the given slots written


@needs_kernel
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_an_8bit_kv_cache_runs_the_fused_step(llama_dir, isa, kv_cache_dtype, quantization):
    """With an int8 / fp8 cache the step is fused too (it writes the codes and scales the per-op
    path writes, and its attention reads them in place): the same bits as the per-op path, pooled and
    forking steps alike. (test_paged_attention's 8-bit cache test holds these logits, now from the
    fused step, against an fp32 recompute.)"""
    if quantization and not kernels_available():
        pytest.skip("the quantised GEMM extension did not build")
    fused, per_op, steps = _fused_and_per_op(
        llama_dir, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    assert steps == len(PROMPT)
    assert torch.equal(fused, per_op)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(llama_dir), num_blocks=64, quantization=quantization,
                  kv_cache_dtype=kv_cache_dtype, thread_policy="fixed")  # fmt: skip
        pooled, forked = _pooled_then_forked(llm, LONG_PROMPT)  # 2 attention splits
        assert torch.equal(pooled, forked)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8", "int4-g32"])
def test_pooled_step_equals_the_step_that_forks_per_linear(llama_dir, isa, quantization):
    """The pooled step (csrc/decode_step.c decode_layers_pooled: its own barrier, norms and
    activation rounding per thread) and the fork/join-per-linear step give the same bits on 2
    threads; both are taken."""
    if quantization and not kernels_available():
        pytest.skip("the quantised GEMM extension did not build")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(llama_dir), num_blocks=64, quantization=quantization, thread_policy="fixed")
        pooled, forked = _pooled_then_forked(llm, PROMPT)
        assert llm.engine.runner.model.fused.num_steps == 2 * len(PROMPT)
        assert torch.equal(pooled, forked)
    finally:
        torch.set_num_threads(threads)


def _pooled_then_forked(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompt` scored one token a step twice: by the pooled step (checked taken at every step), then
    with it switched off (checked not taken)."""
    before = fused_decode.pooled_steps()
    pooled = llm.engine.score(prompt, chunk_size=1)
    assert fused_decode.pooled_steps() - before == len(prompt)
    fused_decode.set_pooled_step(False)
    try:
        forked = llm.engine.score(prompt, chunk_size=1)
    finally:
        fused_decode.set_pooled_step(True)
    assert fused_decode.pooled_steps() - before == len(prompt)  # the second pass forked
    return pooled, forked


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8", "int4-g32"])
def test_guided_panels_give_the_bits_of_fixed_shares(llama_dir, isa, quantization):
    """The pooled step's linears, their panels claimed in shrinking chunks (decode_step.c
    linear_guided, the default) or split in fixed halves, give the same bits at 1 and 16 rows."""
    if quantization and not kernels_available():
        pytest.skip("the quantised GEMM extension did not build")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(
            str(llama_dir), num_blocks=128, max_num_seqs=16, enable_prefix_caching=False,
            quantization=quantization, thread_policy="fixed",
        )  # fmt: skip
        before = fused_decode.pooled_steps()
        guided = llm.engine.score(PROMPT, chunk_size=1), _batch_logprobs(llm, 16)
        fused_decode.set_guided(False)
        try:
            fixed = llm.engine.score(PROMPT, chunk_size=1), _batch_logprobs(llm, 16)
        finally:
            fused_decode.set_guided(True)
        assert fused_decode.pooled_steps() - before >= 2 * (len(PROMPT) + 7)  # all as one region
        assert torch.equal(guided[0], fixed[0]) and guided[1] == fixed[1]
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_guided_panels_in_a_lone_linear_give_the_bits_of_fixed_shares(isa):
    """A linear outside the fused step (the head, prefill: csrc/decode_step.c f32_linear, qgemv.c
    q_linear_x), fp32 or quantised, with its panels claimed in chunks or split in fixed ranges, on 2
    threads: the same bits at any row count. (On the scalar level fp32 inputs above 4 rows go to
    oneDNN, on both sides; the quantised panels take every row count on every level.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(3)
        weight, bias = torch.randn(1000, 96, generator=gen), torch.randn(1000, generator=gen)
        linears = [PackedLinear(weight, bias)]
        assert linears[0].panels is not None
        for name in ("int8", "int4-g32", "w8a8"):
            linears.append(QuantLinear(quantize(weight, parse_tensor_scheme(name)), bias))
            assert linears[-1].layout == "panel"
        for linear in linears:
            for rows in (1, 5, 37, 70):  # 70: q_linear_x rounds the rows split over the threads
                x = torch.randn(rows, 96, generator=gen)
                guided = linear(x)
                fused_decode.set_guided(False)
                try:
                    fixed = linear(x)
                finally:
                    fused_decode.set_guided(True)
                assert torch.equal(guided, fixed), (linear, rows)
    finally:
        torch.set_num_threads(threads)


def _claims(lib, end: int, min_k: int) -> list[tuple[int, int]]:
    """Every chunk one thread claims from a fresh counter over [0, end), as (first, count)."""
    next_panel, first, count = ctypes.c_longlong(0), ctypes.c_longlong(), ctypes.c_longlong()
    chunks = []
    while lib.decode_claim_panels(
        ctypes.byref(next_panel), end, 2, min_k, ctypes.byref(first), ctypes.byref(count)
    ):
        chunks.append((first.value, count.value))
    return chunks


@needs_kernel
def test_panel_claims_of_a_few_rows_hold_at_least_64_kb_of_weights():
    """csrc/decode_step.c: at up to 4 rows a thread claims at least 64 KB of a linear's weights at a
    time (a claim starts a new memory stream; an even panel count), at more rows at least 2 panels;
    the claims shrink,
    cover every panel once, in order, and only the last may be shorter than the minimum."""
    lib = cpu_kernels.load_kernel()
    lib.decode_claim_min_panels.restype = ctypes.c_longlong
    lib.decode_claim_min_panels.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.decode_claim_panels.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                                        ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip

    def min_panels(kind: int, k: int, kp: int, rows: int) -> int:
        desc = fused_decode._Linear(kind=kind, n=576, k=k, kp=kp)
        return lib.decode_claim_min_panels(ctypes.byref(desc), rows)

    f32, q8, bf16, q4 = 0, 1, 3, 2  # csrc/decode_step.h LIN_*
    # panel bytes: fp32 16 x 576 x 4 = 36,864; bf16 half; int8 8 x 576; int4 half of that
    # rounded up to an even count (the AVX-512 quantised kernel takes pairs of panels)
    assert [min_panels(kind, 576, 576, 1) for kind in (f32, bf16, q8, q4)] == [2, 4, 16, 30]
    assert min_panels(q8, 1536, 1536, 4) == 6 and min_panels(f32, 4096, 4096, 1) == 2
    assert [min_panels(kind, 576, 576, 5) for kind in (f32, bf16, q8, q4)] == [2, 2, 2, 2]
    for end, min_k in ((72, 16), (72, 2), (6144, 16), (10, 30), (1, 2)):
        chunks = _claims(lib, end, min_k)
        assert [c for c, _ in chunks] == [sum(k for _, k in chunks[:i]) for i in range(len(chunks))]
        assert sum(k for _, k in chunks) == end
        assert all(k >= min_k for _, k in chunks[:-1]) and chunks[-1][1] >= 1
        assert all(a >= b for (_, a), (_, b) in zip(chunks, chunks[1:], strict=False))
    assert len(_claims(lib, 72, 16)) < len(_claims(lib, 72, 2))


LONG_PROMPT = [(i * 53 + 7) % 250 + 3 for i in range(400)]  # 2 attention splits of 256 positions


@needs_kernel
def test_pooled_step_splits_a_long_context_with_the_same_bits_as_the_forking_step(llama_dir, isa):
    """Past one attention split (256 positions) the pooled step still runs (no context limit): it
    cuts the attention's items over its threads and merges the splits itself, with the same bits as
    paged_decode_attention forking over its threads; both close to a one-pass torch recompute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(llama_dir), num_blocks=64, thread_policy="fixed")
        pooled, forked = _pooled_then_forked(llm, LONG_PROMPT)
        assert torch.equal(pooled, forked)
        reference = LLM(str(llama_dir), num_blocks=64, attention_backend="torch")
        expected = reference.engine.score(LONG_PROMPT)
        assert_logits_close(pooled, expected, 1e-4, f"pooled step at 400 positions ({isa})")
    finally:
        torch.set_num_threads(threads)


def _batch_logprobs(llm: LLM, count: int) -> list:
    """Greedy tokens and their logprobs for `count` concurrent requests (decode steps of `count`
    rows once the prompts are in)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [[(i * 31 + j * 7 + 3) % 250 + 3 for j in range(5 + 3 * i)] for i in range(count)]
    outputs = llm.generate(prompts, params)
    return [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outputs]


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8", "int4-g32"])
def test_pooled_step_runs_16_rows_with_the_forking_steps_bits(llama_dir, isa, quantization):
    """Steps of up to 16 rows, fp32 or quantised, run fused (decode_step_max_rows: the quantised GEMV
    takes pairs of panels above 4 rows), as one region, with the same bits as the forking step;
    capped at 4 rows, those steps take the per-op path instead, with the same tokens."""
    if quantization and not kernels_available():
        pytest.skip("the quantised GEMM extension did not build")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fused_decode.max_step_rows() == 64
        llm = LLM(
            str(llama_dir), num_blocks=128, max_num_seqs=16, enable_prefix_caching=False,
            quantization=quantization, thread_policy="fixed",  # 2 threads even beside a neighbour
        )  # fmt: skip
        _batch_logprobs(llm, 2)  # builds the fused step
        fused = llm.engine.runner.model.fused
        assert fused is not None and fused.max_rows() == 64
        steps, pooled = fused.num_steps, fused_decode.pooled_steps()
        pooled_run = _batch_logprobs(llm, 16)
        big_steps = fused.num_steps - steps
        assert big_steps >= 7 and fused_decode.pooled_steps() - pooled == big_steps
        fused_decode.set_pooled_step(False)
        try:
            forked_run = _batch_logprobs(llm, 16)
        finally:
            fused_decode.set_pooled_step(True)
        assert pooled_run == forked_run
        fused_decode.set_f32_max_rows(4)
        try:
            steps = fused.num_steps
            per_op_run = _batch_logprobs(llm, 16)
            assert fused.num_steps - steps < big_steps  # the 16-row steps went per-op
        finally:
            fused_decode.set_f32_max_rows(64)
        for pooled_req, per_op_req in zip(pooled_run, per_op_run, strict=True):
            assert [t for t, _ in pooled_req] == [t for t, _ in per_op_req]
            diffs = [abs(a - b) for (_, a), (_, b) in zip(pooled_req, per_op_req, strict=True)]
            assert max(diffs) < 1e-4
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_fused_step_equals_a_one_pass_torch_recompute(llama_dir, isa):
    """Oracle: one pass over the prompt through the pure-torch reference path (no C kernels)."""
    fused, _, _ = _fused_and_per_op(llama_dir)
    reference = LLM(str(llama_dir), num_blocks=64, attention_backend="torch").engine.score(PROMPT)
    assert_logits_close(fused, reference, 1e-4, f"fused ({isa}) vs torch recompute")


@needs_kernel
def test_fused_step_off_for_the_torch_backend_and_large_prompt_chunks(llama_dir):
    torch_llm = LLM(str(llama_dir), num_blocks=64, attention_backend="torch")
    torch_llm.engine.score(PROMPT, chunk_size=1)
    assert torch_llm.engine.runner.model.fused is None
    llm = LLM(str(llama_dir), num_blocks=64)
    long_prompt = PROMPT * 2  # 80 tokens: more than the fused step's rows
    assert len(long_prompt) > fused_decode.max_step_rows()
    llm.engine.score(long_prompt)  # one prompt chunk: the per-op path (flash attention)
    assert llm.engine.runner.model.fused is None


def test_which_steps_run_row_by_row():
    """runner/forward.py attends_by_row: a prompt chunk while its rows x context is within
    PER_ROW_MAX_WORK, a decode row always; as_rows gives each such token its own position and
    context. (Whether the step then runs fused is the decoder's rule: rows only, at most
    max_step_rows(); the large-step tests below.)"""
    from kvserve.runner.forward import PER_ROW_MAX_WORK, as_rows, attends_by_row

    blocks = (7, 8, 9)
    assert attends_by_row(0, 40)
    assert attends_by_row(PER_ROW_MAX_WORK // 32 - 32, 32)  # rows x context at the bound
    assert not attends_by_row(PER_ROW_MAX_WORK // 32 - 31, 32)
    assert attends_by_row(10_000, 1)  # decode rows: any context
    assert as_rows([(5, 3, blocks), (40, 1, (1,))]) == [
        (5, 1, blocks), (6, 1, blocks), (7, 1, blocks), (40, 1, (1,))
    ]  # fmt: skip
    long_chunk = (PER_ROW_MAX_WORK // 32 - 31, 32, blocks)  # past the bound: attends at once
    assert as_rows([(0, 2, blocks), long_chunk]) == [(0, 1, blocks), (1, 1, blocks), long_chunk]


@needs_kernel
def test_a_prompt_gives_the_same_bits_alone_and_in_a_step_too_large_to_fuse(llama_dir):
    """Three prompts of 100 tokens in all take the per-op path (more rows than the fused step's);
    each still attends row by row, so every token and logprob equals the prompt's run alone (fused)
    bit for bit."""
    llm = LLM(str(llama_dir), num_blocks=128, enable_prefix_caching=False)
    prompts = [PROMPT, PROMPT[:30][::-1], PROMPT[5:35]]
    assert sum(map(len, prompts)) > fused_decode.max_step_rows()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)

    def key(output):
        return [(lp.token_id, lp.logprob, lp.top) for lp in output.outputs[0].logprobs]

    alone = [key(llm.generate([prompt], params)[0]) for prompt in prompts]
    assert [key(o) for o in llm.generate(prompts, params)] == alone


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8", "int4-g32"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_small_prompt_chunk_runs_fused_with_the_decode_steps_bits(
    llama_dir, isa, quantization, kv_cache_dtype, monkeypatch
):
    """A prompt of 40 tokens in one chunk (and in chunks of 16, the later ones reading the cached
    earlier ones) runs as one fused step of 40 rows: the same bits as 40 decode steps of one row
    (each position's attention is the decode kernel's, each linear the same panel GEMV whatever the
    rows), and within 1e-4 of the chunk attended at once by torch's flash kernel (the per-op path,
    as before; 5e-2 with quantised linears, which round activations to int8) and, with fp32 weights
    and cache, of the pure-torch recompute (the oracle)."""
    from kvserve.runner import forward

    if quantization and not kernels_available():
        pytest.skip("the quantised GEMM extension did not build")
    options = dict(num_blocks=64, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(str(llama_dir), **options)
    model = llm.engine.runner.model
    one_by_one = llm.engine.score(PROMPT, chunk_size=1)
    steps = model.fused.num_steps
    whole = llm.engine.score(PROMPT)
    assert model.fused.num_steps == steps + 1  # the whole prompt in one fused step
    assert torch.equal(whole, one_by_one)
    chunked = llm.engine.score(PROMPT, chunk_size=16)
    assert model.fused.num_steps == steps + 1 + 3
    assert torch.equal(chunked, one_by_one)
    monkeypatch.setattr(forward, "PER_ROW_MAX_WORK", 0)  # prompt chunks attend at once again
    flash = llm.engine.score(PROMPT)
    assert model.fused.num_steps == steps + 4
    # quantised linears round their input rows to int8: a last-bit change of the attention's output
    # can move one code, a step far above 1e-4 (the kernels' own tests hold each code exactly)
    tolerance = 1e-4 if quantization is None else 5e-2
    assert_logits_close(whole, flash, tolerance, f"row by row ({isa}) vs the chunk at once")
    if quantization is None and kv_cache_dtype == "auto":
        reference = LLM(str(llama_dir), attention_backend="torch", **options).engine.score(PROMPT)
        assert_logits_close(whole, reference, 1e-4, f"row by row ({isa}) vs torch recompute")


def test_without_a_compiler_the_per_op_path_runs(llama_dir, tmp_path):
    """No compiler: no fused step, no small-row GEMV; the model still runs (torch ops, oneDNN)."""
    code = (
        "import sys; from kvserve import LLM; from kvserve.model import fused_decode\n"
        f"llm = LLM({str(llama_dir)!r}, num_blocks=64)\n"
        f"logits = llm.engine.score({PROMPT!r}, chunk_size=1)\n"
        "assert fused_decode.max_rows() == 0 and llm.engine.runner.model.fused is None\n"
        "print(float(logits.abs().sum()))\n"
    )
    env = dict(os.environ, PATH=str(tmp_path), KVSERVE_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split()[-1]) > 0


@needs_kernel
def test_silu_mul_equals_torch_on_every_isa_with_nan_and_infinities(isa):
    """csrc/layer_ops.c silu_mul (the vector exp where AVX2 is allowed, expf in the portable loops)
    against torch's silu(gate) * up in float64: 1e-6 relative; widths not a multiple of the 8-wide
    vector (13, 1536 + 5); a NaN stays NaN and +-inf give what silu * up gives (inf, NaN)."""
    from kvserve.model import cpu_kernels

    gen = torch.Generator().manual_seed(9)
    for rows, inter in [(1, 13), (3, 1541), (40, 64)]:
        gate_up = torch.randn(rows, 2 * inter, generator=gen) * 8
        gate_up[0, 0], gate_up[0, 1], gate_up[0, 2] = float("nan"), float("inf"), float("-inf")
        gate_up[0, 3], gate_up[0, 4] = -100.0, 100.0  # exp(-g) under- and overflows
        got = cpu_kernels.silu_mul(gate_up)
        g, u = gate_up.double().chunk(2, dim=-1)
        expected = (torch.nn.functional.silu(g) * u).float()
        assert torch.equal(got.isnan(), expected.isnan()), isa
        finite = expected.isfinite()
        assert torch.equal(got[~finite & ~got.isnan()], expected[~finite & ~expected.isnan()])
        torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-30)


@needs_kernel
def test_bf16_exact_weights_take_bf16_panels_with_the_fp32_bits(isa, monkeypatch):
    """Weights that are all bf16 values (a bf16 checkpoint served in fp32) are held as bf16 panels,
    half the bytes; every row count gives the bits the fp32 panels of the same values give (the
    kernels widen each weight exactly); any other weight keeps fp32 panels."""
    gen = torch.Generator().manual_seed(11)
    # 120: 8 panels, the partial last one inside the AVX2 one-row group of 4
    for n, k in [(37, 77), (200, 33), (64, 576), (120, 33)]:
        w = torch.randn(n, k, generator=gen).bfloat16().float()
        b = torch.randn(n, generator=gen)
        linear = PackedLinear(w, b)
        assert linear.panels.dtype == torch.bfloat16
        with monkeypatch.context() as patch:
            patch.setattr(fused_decode, "bf16_exact", lambda weight: False)
            reference = PackedLinear(w, b)
        assert reference.panels.dtype == torch.float32
        for rows in [1, 2, 3, 4, 5, 7, 16, 40]:
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(linear(x), reference(x)), f"{n}x{k}, {rows} rows ({isa})"
    w[0, 0] = 1 + 2**-20  # not a bf16 value (8 bits of mantissa)
    assert PackedLinear(w, None).panels.dtype == torch.float32


@needs_kernel
def test_a_bf16_checkpoint_runs_on_bf16_panels_with_the_fp32_logits(tmp_path, monkeypatch):
    """A bf16 checkpoint (served in fp32 on CPU) holds its projections and tied head as bf16 panels,
    the embedding read from them; its logits, token by token through the fused step and for a
    whole prompt, equal those of the same values on fp32 panels bit for bit."""
    from kvserve.model.linear import PanelEmbedding
    from tests.checkpoints import build_checkpoint

    hf = build_checkpoint(tmp_path / "fp32", "llama_tied")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")

    def logits():
        llm = LLM(str(tmp_path / "bf16"), num_blocks=64)
        model = llm.engine.runner.model
        panels = [m.panels.dtype for m in model.modules() if isinstance(m, PackedLinear)]
        by_token = llm.engine.score(PROMPT, chunk_size=1)
        assert model.fused is not None and model.fused.num_steps == len(PROMPT)
        return panels, model.embed_tokens, by_token, llm.engine.score(PROMPT)

    panels, embed, by_token, whole = logits()
    assert panels and set(panels) == {torch.bfloat16}  # q/k/v, o, gate/up, down, the head
    assert isinstance(embed, PanelEmbedding) and embed.panels.dtype == torch.bfloat16
    monkeypatch.setattr(fused_decode, "bf16_exact", lambda weight: False)
    ref_panels, _, ref_by_token, ref_whole = logits()
    assert set(ref_panels) == {torch.float32}
    assert torch.equal(by_token, ref_by_token) and torch.equal(whole, ref_whole)


@needs_kernel
def test_each_layer_op_gives_the_same_bits_on_one_thread_and_in_a_parallel_region(isa):
    """csrc/layer_ops.c: above its size threshold an op splits its rows over a parallel region, below
    it (or on one thread: every call inside the fused step) it runs them in a plain loop, with no
    region at all (a nested `omp parallel if (0)` still builds a team: 13% of a batch-1 step). Both
    paths call the same row function: on shapes past every threshold, 2 threads and 1 give the same
    bits, and match the torch reference of each op."""
    from kvserve.model.kv_cache import allocate_layers

    gen = torch.Generator().manual_seed(21)
    rows, dim, heads, kv_heads, head_dim, inter = 256, 576, 9, 3, 64, 1024
    x, res = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=gen)
    angle = torch.rand(rows, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    slots = torch.randperm(rows * 2, generator=gen)[:rows]

    def run() -> list[torch.Tensor]:
        normed, stream = cpu_kernels.add_rms_norm(x, res, weight, 1e-6)
        rotated = qkv.clone()
        cpu_kernels.rotary_(rotated, cos, sin, heads + kv_heads, head_dim)
        k = rotated[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
            rows, kv_heads, head_dim
        )
        v = rotated[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        caches = []
        for kind in ("auto", "int8"):
            _, (cache,) = allocate_layers(
                1, rows * 2 // 16, 16, kv_heads, head_dim, torch.float32, kind, torch.device("cpu")
            )
            if kind == "auto":
                cpu_kernels.write_kv(k, v, slots, cache.k, cache.v)
                caches += [cache.k.clone(), cache.v.clone()]
            else:
                cpu_kernels.write_kv_q(k, v, slots, cache)
                caches += [cache.k.clone(), cache.v.clone(), cache.k_scale.clone()]
        return [normed, stream, rotated, cpu_kernels.silu_mul(gate_up), *caches]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        parallel = run()
        torch.set_num_threads(1)
        serial = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(parallel, serial, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)  # fmt: skip
    h = x.double() + res.double()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    torch.testing.assert_close(serial[0].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(serial[1], x + res)
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(
        serial[3].double(), torch.nn.functional.silu(g) * u, rtol=1e-6, atol=1e-6
    )
