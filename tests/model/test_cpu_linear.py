"""The CPU linear layouts compute exactly what nn.Linear computes, for every row count the engine uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.linear import PackedLinear, TransposedLinear, cpu_linear, onednn_available

LAYOUTS = [TransposedLinear] + ([PackedLinear] if onednn_available() else [])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 77])
def test_cpu_linear_equals_f_linear(layout, with_bias, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen) / 40**0.5
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    expected = F.linear(x, weight, bias)
    actual = layout(weight, bias)(x)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a column slice, as after a fused projection's split) gives the same
    wide = torch.cat([x, torch.zeros(rows, 8)], dim=1)[:, :40]
    torch.testing.assert_close(layout(weight, bias)(wide), expected, rtol=1e-5, atol=1e-5)


def test_cpu_linear_picks_the_packed_layout_for_fp32_when_onednn_runs():
    weight = torch.randn(8, 4)
    chosen = cpu_linear(weight)
    assert isinstance(chosen, PackedLinear if onednn_available() else TransposedLinear)
    assert isinstance(cpu_linear(weight.to(torch.bfloat16)), TransposedLinear)  # fp32 only
