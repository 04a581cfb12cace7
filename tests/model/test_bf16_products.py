"""bf16 products, fp32 sums (`--quantization linear=bf16,head=bf16` on CPU; csrc/bf16dot.c): the
kernel against an fp64 product of the bf16-rounded inputs, every instruction path against the others
bit for bit, and a model against transformers whose linears round the same way."""

from __future__ import annotations

import shutil
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM
from kvserve.model import fused_decode
from kvserve.model.linear import PackedLinear
from kvserve.model.parallel_quant import check_tensor_parallel_scheme
from kvserve.model.qlinear import kernel_summary
from kvserve.quant.scheme import QuantizationError, parse_weight_scheme

needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(40)]
BF16 = "linear=bf16,head=bf16"


def _paths() -> list[tuple[str, bool]]:
    """(isa cap, vdpbf16ps allowed) for every path this CPU can run: the instruction, its emulation
    on fp32 multiply-adds, the portable loops (AVX2 takes the portable loops too)."""
    isas = fused_decode.available_isas()
    paths = [("scalar", False)] + ([("avx2", False)] if "avx2" in isas else [])
    if "avx512" in isas:
        paths.append(("avx512", False))
        fused_decode.reset_isa()
        if fused_decode.bf16_insn():
            paths.append(("avx512", True))
    return paths


def _on_path(path: tuple[str, bool], fn):
    isa, insn = path
    fused_decode.set_max_isa(isa)
    fused_decode.set_bf16_insn(insn)
    try:
        return fn()
    finally:
        fused_decode.reset_isa()
        fused_decode.set_bf16_insn(True)


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_products_equal_the_fp64_product_of_the_rounded_inputs_on_every_path(bias):
    gen = torch.Generator().manual_seed(0)
    # K = 77: odd (a padded pair); N = 37: not a multiple of the 16-column panel
    # K = 1,101: 551 pairs, odd, the down projection's length class
    for n, k in [(37, 77), (96, 64), (50, 576), (40, 1101)]:
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        linear = PackedLinear(w, b, bf16_products=True)
        assert linear.panels.dtype == torch.bfloat16 and linear.panels.dim() == 4
        x = torch.randn(120, k, generator=gen)
        expected = _rounded(x) @ _rounded(w).T + (0 if b is None else b.double())
        results = {}
        for path in _paths():
            # every row count's tiles (1-3 rows: 4 panels side by side; 6-row tiles and remainders)
            for m in (1, 2, 3, 4, 5, 7, 16, 33, 120):
                y = _on_path(path, partial(linear, x[:m]))
                tol = 1e-5 * max(1.0, k / 200)  # fp32 sums of k products
                torch.testing.assert_close(y.double(), expected[:m], atol=tol, rtol=tol)
                results.setdefault(m, []).append((path, y))
        for m, ys in results.items():
            for path, y in ys[1:]:
                assert torch.equal(y, ys[0][1]), f"{path} differs from {ys[0][0]} at {m} rows"
            # a row's sums do not depend on the rows beside it
            assert torch.equal(ys[0][1], results[120][0][1][:m])


@needs_kernel
def test_activations_round_to_nearest_even_and_subnormals_flush_to_zero():
    # y = x W^T with W the identity: the kernel's rounding of x, one value per column
    linear = PackedLinear(torch.eye(8), None, bf16_products=True)
    # (no infinity: inf x 0 is NaN in the other columns)
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-7 * (1 + 2**-8)]  # halfway: to even
    x = torch.tensor(
        [
            ties + [1e-39, -1e-39, 3.0e38, -3.3e38],
            [0.1, -0.3, 1 / 3, 7.0, 65504.0, 1e-20, -2.5, 0.0],
        ]
    )
    expected = x.to(torch.bfloat16).float()
    expected[0, 4:6] = 0.0  # subnormal fp32 inputs: zero, as vdpbf16ps reads them
    for path in _paths():
        y = _on_path(path, lambda: linear(x))
        assert torch.equal(y, expected), path
    assert torch.equal(expected[0, :4], torch.tensor([1.0, 1 + 2**-6, -1.0, 2**-7]))


@needs_kernel
def test_a_model_with_bf16_products_matches_transformers_with_bf16_linears(checkpoints):
    model_dir, hf = checkpoints["llama"]
    llm = LLM(str(model_dir), num_blocks=64, quantization=BF16)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * len(model.layers) + 1 and all(m.bf16_products for m in linears)
    expected_kernel = (
        "bf16dot-avx512bf16" if fused_decode.bf16_insn() else linears[0].products_kernel
    )
    assert kernel_summary(model) == {expected_kernel: len(linears)}
    logits = llm.engine.score(PROMPT)

    def bf16_linear(module, args, kwargs=None):
        (x,) = args
        w = module.weight.to(torch.bfloat16).float()
        return F.linear(x.to(torch.bfloat16).float(), w, module.bias)

    hooks = [
        m.register_forward_hook(lambda mod, args, out: bf16_linear(mod, args))
        for m in hf.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.no_grad():
            expected = hf(torch.tensor([PROMPT])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        fp32 = hf(torch.tensor([PROMPT])).logits[0]
    # Rounding to bf16 is a step function: where two fp32 computations of an activation differ in
    # the last bit (another summation order) and straddle a bf16 rounding boundary, one input of
    # the next linear moves by a bf16 step, and that position's logits with it. Most positions
    # agree to fp32 precision; the others stay far closer to this oracle than to fp32 products.
    per_position = (logits - expected).abs().amax(dim=-1)
    assert (per_position <= 1e-5).float().mean() >= 0.8, per_position
    bf16_vs_fp32 = (expected - fp32).abs().max()
    assert bf16_vs_fp32 > 1e-2  # the products are bf16 ones, not fp32
    assert per_position.max() < bf16_vs_fp32 / 4, (per_position.max(), bf16_vs_fp32)


@needs_kernel
def test_the_fused_step_and_the_pooled_step_take_bf16_products_with_the_per_op_bits(llama_dir):
    llm = LLM(str(llama_dir), num_blocks=64, quantization=BF16)
    model = llm.engine.runner.model
    fused = llm.engine.score(PROMPT, chunk_size=1)  # every position a decode row
    assert model.fused is not None and model.fused.num_steps == len(PROMPT)
    whole = llm.engine.score(PROMPT)  # one prompt step: the per-op path's GEMM
    model.fused_decode, model.fused = False, None
    per_op = llm.engine.score(PROMPT, chunk_size=1)
    assert torch.equal(fused, per_op) and torch.equal(fused, whole)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model.fused_decode, model.fused = True, None
        before = fused_decode.pooled_steps()
        pooled = llm.engine.score(PROMPT, chunk_size=1)
        assert fused_decode.pooled_steps() > before
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(pooled, fused)


def test_bf16_names_the_products_and_tensor_parallel_refuses_them():
    scheme = parse_weight_scheme(BF16)
    assert scheme.runs_bf16 and not scheme.is_quantized
    assert parse_weight_scheme("bf16").bf16_products("linear")
    assert not parse_weight_scheme("bf16").bf16_products("head")
    assert not parse_weight_scheme("fp32").runs_bf16
    with pytest.raises(QuantizationError, match="one rank"):
        check_tensor_parallel_scheme(scheme, SimpleNamespace(world_size=2))  # refused first


def test_dtype_bfloat16_on_cpu_points_to_the_bf16_products(llama_dir, caplog):
    with caplog.at_level("WARNING", logger="kvserve.model.loader"):
        LLM(str(llama_dir), num_blocks=16, dtype="bfloat16")
    assert any("--quantization linear=bf16,head=bf16" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "scheme, head",
    [
        ("embed=bf16", "bf16"),  # a tied head follows the table
        ("linear=int8,embed=bf16", "bf16"),
        ("linear=int8,embed=int8,head=bf16", "bf16"),  # a named head keeps its format
        ("linear=int8,embed=int8,head=fp32", "fp32"),
        ("linear=int8,embed=int8", "int8"),
    ],
)
def test_a_tied_head_follows_the_table_unless_it_is_named(checkpoints, scheme, head):
    from kvserve.model.qlinear import QuantEmbedding, QuantLinear

    model_dir, _ = checkpoints["llama_tied"]
    llm = LLM(str(model_dir), num_blocks=16, quantization=scheme)
    model = llm.engine.runner.model
    cpu_head = model.cpu_head
    if head == "int8":
        assert isinstance(cpu_head, QuantLinear)
    else:
        assert isinstance(cpu_head, PackedLinear)
        assert cpu_head.bf16_products == (head == "bf16")
    if "embed=int8" in scheme:
        assert isinstance(model.embed_tokens, QuantEmbedding)
    logits = llm.engine.score(PROMPT[:8])
    assert torch.isfinite(logits).all()


def test_the_torch_fallback_takes_a_bf16_bias_and_flushes_subnormals(monkeypatch):
    monkeypatch.setattr(fused_decode, "max_rows", lambda: 0)  # as without a C compiler
    w = torch.randn(5, 6)
    bias = torch.randn(5).to(torch.bfloat16)  # a bf16 model's bias (Qwen2's q/k/v)
    linear = PackedLinear(w, bias, bf16_products=True)
    assert linear.products_kernel == "bf16dot-torch"
    x = torch.randn(3, 6).to(torch.bfloat16)
    expected = F.linear(x.float(), w.to(torch.bfloat16).float(), bias.float())
    torch.testing.assert_close(linear(x).float(), expected.to(torch.bfloat16).float())
    # a subnormal weight or activation counts as zero, as vdpbf16ps reads it
    tiny = torch.zeros(1, 6)
    tiny[0, 0] = 1e-39
    big = torch.zeros(1, 6)
    big[0, 0] = 1e20
    assert PackedLinear(tiny, None, bf16_products=True)(big).item() == 0.0
    assert PackedLinear(big, None, bf16_products=True)(tiny).item() == 0.0


def test_quantize_refuses_bf16_products_and_the_warning_knows_them(llama_dir, caplog):
    from kvserve.quant.convert import check_artifact_scheme

    for text in (BF16, "linear=int8,head=bf16"):
        with pytest.raises(QuantizationError, match="load-time"):
            check_artifact_scheme(parse_weight_scheme(text))
    with caplog.at_level("WARNING", logger="kvserve.model.loader"):
        LLM(str(llama_dir), num_blocks=16, dtype="bfloat16", quantization=BF16)
    assert not any("--quantization linear=bf16" in r.getMessage() for r in caplog.records)


def test_the_manifest_names_what_runs_the_bf16_products(llama_dir):
    from kvserve.model.kernel_choice import served_kernels
    from kvserve.quant.scheme import parse_weight_scheme
    from kvserve.server.manifest import build_manifest

    manifest = build_manifest(
        llama_dir, served_model_name="m", dtype="float32", chat_template=None,
        engine_options={"quantization": BF16},
        **served_kernels(llama_dir, parse_weight_scheme(BF16)),
    )  # fmt: skip
    quant = manifest["quantization"]
    assert quant["scheme"] == BF16
    expected = "vdpbf16ps" if fused_decode.bf16_insn() else quant["bf16_products"]
    assert quant["bf16_products"] == expected
    assert quant["bf16_products"] in ("vdpbf16ps", "avx512-fma", "portable", "torch")
