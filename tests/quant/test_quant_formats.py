"""Quantisation formats: hand-computed examples, exact dequantisation, and bits per weight equal to
plan's formula (docs/quantization.md)."""

from __future__ import annotations

import pytest
import torch

from kvserve.lab.plan.formats import parse_tensor_format
from kvserve.lab.plan.model import TensorShape
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import (
    QuantizationError,
    parse_tensor_scheme,
    parse_weight_scheme,
)


def test_seed_eight_weight_zero_point_example():
    # min -0.46, max 0.93: s = 1.39 / 15, z = round(0.46 / s) = 5
    w = torch.tensor([[0.1, -0.46, 0.0, 0.93, -0.1, 0.3, -0.35, 0.05]])
    scheme = parse_tensor_scheme("int4-zp")  # one group: the whole row
    qt = quantize(w, scheme)
    assert qt.scales.dtype == torch.float16
    assert qt.scales.item() == pytest.approx(1.39 / 15, rel=1e-3)  # fp16 rounding
    assert qt.zeros.item() == 5
    assert qt.codes.tolist() == [[6, 0, 5, 15, 4, 8, 1, 6]]
    expected = (torch.tensor([6, 0, 5, 15, 4, 8, 1, 6]) - 5) * qt.scales.float()[0]
    torch.testing.assert_close(qt.dequantize()[0], expected, rtol=0, atol=0)
    assert (qt.dequantize() - w).abs().max() <= qt.scales.float().item() / 2 + 1e-6


def test_symmetric_int8_per_channel_example():
    w = torch.tensor([[0.5, -1.27, 0.01], [0.0, 0.0, 0.0]])
    qt = quantize(w, parse_tensor_scheme("int8"))
    assert qt.scales[0].item() == pytest.approx(0.01, rel=1e-3)
    assert qt.codes[0].tolist() == [50, -127, 1]
    assert qt.codes[1].tolist() == [0, 0, 0] and qt.scales[1].item() == 1.0  # constant group guard
    assert torch.equal(qt.dequantize()[1], torch.zeros(3))


def test_groups_and_a_short_last_group():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 80, generator=gen)  # 80 = 64 + a short group of 16
    qt = quantize(w, parse_tensor_scheme("int4-g64"))
    assert qt.scales.shape == (3, 2)
    # each group's scale is its own absmax / 7
    torch.testing.assert_close(
        qt.scales[:, 1].float(), (w[:, 64:].abs().amax(1) / 7).half().float()
    )
    assert qt.codes.abs().max() <= 7
    err = (qt.dequantize() - w).abs()
    assert (err <= qt.expanded(qt.scales) / 2 + 1e-6).all()


def test_per_tensor_int4_has_one_scale_and_is_worse_than_groups():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-2, 0, 64).unsqueeze(1)
    pt = quantize(w, parse_tensor_scheme("int4-pt"))
    assert pt.scales.shape == (1, 1)
    errors = {
        name: (quantize(w, parse_tensor_scheme(name)).dequantize() - w).norm().item()
        for name in ("int4-pt", "int4", "int4-g128", "int4-g64", "int4-g32")
    }
    assert errors["int4-pt"] > errors["int4"] > errors["int4-g128"]
    assert errors["int4-g128"] > errors["int4-g64"] > errors["int4-g32"]


@pytest.mark.parametrize(
    "name", ["int8", "int4-g32", "int4-g64", "int4-g128", "int4-g128-zp", "int8-g128"]
)
@pytest.mark.parametrize("shape", [(96, 576), (40, 200)])
def test_bits_per_weight_equal_plans_formula(name, shape):
    rows, cols = shape
    qt = quantize(torch.randn(rows, cols), parse_tensor_scheme(name))
    plan_bits = 8 * parse_tensor_format(name).num_bytes(TensorShape("w", "linear", rows, cols))
    assert qt.num_bits == plan_bits
    # the actual stored tensors: codes at `bits` each, one fp16 per scale and zero-point
    stored = qt.codes.numel() * qt.scheme.bits + 16 * (
        qt.scales.numel() + (qt.zeros.numel() if qt.zeros is not None else 0)
    )
    assert stored == plan_bits
    if name == "int4-g128" and cols == 576:
        assert qt.scheme.bits_per_weight(rows, cols) == pytest.approx(4 + 16 * 5 / 576)


def test_w8a8_and_mixed_schemes():
    assert parse_tensor_scheme("w8a8").act == "token"
    assert parse_tensor_scheme("w8a8-pt").act == "tensor"
    scheme = parse_weight_scheme("linear=int4-g64,embed=int8,head=fp32")
    assert scheme.linear.name == "int4-g64" and scheme.embed.name == "int8"
    assert scheme.for_class("head") is None  # fp32 stays unquantised
    mixed = parse_weight_scheme("mixed")
    assert (mixed.linear.name, mixed.embed.name, mixed.head.name) == ("int4-g128", "int8", "int8")
    assert parse_weight_scheme("int8").for_class("head") is None


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("int3-g128", "no kernel"),
        ("int4-g100", "multiple of 32"),
        ("int8-zp", "symmetric only"),
        ("nf4", "unknown quantisation format"),
        ("linear=int4,bias=int8", "unknown tensor class"),
        ("embed=w8a8", "lookup"),
        ("", "empty"),
    ],
)
def test_bad_formats_name_the_choice(bad, needle):
    with pytest.raises(QuantizationError, match=needle):
        parse_weight_scheme(bad)


@pytest.mark.parametrize("name", ["int8", "int4-g32"])
def test_a_quantised_embedding_looks_up_its_rows_and_refuses_ids_outside_the_table(name):
    """QuantEmbedding (an `embed=` format): a row is its dequantised codes; an id outside
    [0, rows), a negative one too (it used to wrap to the last row), is an IndexError."""
    from kvserve.model.qlinear import QuantEmbedding

    table = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    qt = quantize(table, parse_tensor_scheme(name))
    embed = QuantEmbedding(qt, torch.float32, "cpu")
    rows = embed(torch.tensor([0, 39, 7]))
    assert rows.shape == (3, 64) and torch.equal(rows, embed(torch.tensor([0, 39, 7])))
    assert (rows - table[[0, 39, 7]]).abs().max() < 0.1 * table.abs().max()
    assert embed(torch.tensor([], dtype=torch.long)).shape == (0, 64)
    for bad in ([40], [-1], [3, 40]):
        with pytest.raises(IndexError, match="embedding of 40 rows"):
            embed(torch.tensor(bad))
