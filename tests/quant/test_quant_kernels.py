"""Each quantised kernel equals its dequantised fp32 reference (docs/quantization.md, "kernels").

Two references per case:
- exact: the dequantised weight times the activations rounded as the kernel rounds them
  (`round_activations`): only fp32 summation order differs, so the tolerance is 1e-4 relative to the
  output's scale;
- fp32: the dequantised weight times the unrounded activations, within the stated activation-rounding
  tolerance (relative Frobenius error: 1% for per-32 rounding, 3% per token, 5% per tensor).
Both for the AVX2 path (when this CPU has it) and the scalar fallback.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.kernel_choice import set_max_isa
from kvserve.model.qlinear import QuantLinear, round_activations
from kvserve.quant import kernels
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import parse_tensor_scheme

pytestmark = pytest.mark.skipif(not kernels.kernels_available(), reason="no C++ toolchain")

SCHEMES = ["int8", "int8-g64", "w8a8", "w8a8-pt", "int4", "int4-g32", "int4-g64", "int4-g128"]
SCHEMES += ["int4-g128-zp", "int4-pt"]
ACT_TOLERANCE = {"block": 0.01, "token": 0.03, "tensor": 0.05}
ISAS = ["scalar"] + (["avx2"] if kernels.kernel_isa() == "avx2" else [])  # this extension's


@pytest.fixture(params=ISAS)
def isa(request):
    set_max_isa(request.param)
    yield request.param
    set_max_isa("avx512")


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("rows", [1, 3, 16, 77])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_dequantized_reference(isa, name, rows, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + with_bias)
    in_features, out_features = 200, 48  # 200: not a multiple of 32, 64 or 128
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    qt = quantize(weight, parse_tensor_scheme(name))
    layer = QuantLinear(qt, bias)
    assert layer.kernel == f"kvq-int{qt.scheme.bits}-{isa}"
    actual = layer(x)
    w_deq = qt.dequantize()
    exact = F.linear(round_activations(x, qt.scheme.act), w_deq, bias)
    scale = exact.abs().max().item()
    torch.testing.assert_close(actual, exact, rtol=0, atol=1e-4 * scale)
    reference = F.linear(x, w_deq, bias)
    rel = ((actual - reference).norm() / reference.norm()).item()
    assert rel < ACT_TOLERANCE[qt.scheme.act], rel


def test_kernel_takes_a_strided_input_and_keeps_leading_dims():
    weight = torch.randn(64, 96)
    qt = quantize(weight, parse_tensor_scheme("int4-g32"))
    layer = QuantLinear(qt, None)
    wide = torch.randn(5, 128)[:, :96]  # a column slice, as after a fused projection's split
    expected = F.linear(round_activations(wide.contiguous(), "block"), qt.dequantize())
    torch.testing.assert_close(layer(wide), expected, rtol=1e-5, atol=1e-4)
    assert layer(torch.zeros(0, 96)).shape == (0, 64)
    assert layer(torch.randn(2, 3, 96)).shape == (2, 3, 64)


def test_no_kernel_device_runs_the_same_function():
    weight, x = torch.randn(32, 72), torch.randn(4, 72)
    qt = quantize(weight, parse_tensor_scheme("w8a8"))
    fast = QuantLinear(qt, None)
    stand_in = QuantLinear(qt, None, device="meta")  # any non-CPU device takes the dequantised path
    assert stand_in.kernel == "dequantized-meta"
    stand_in.weight_deq = qt.dequantize()  # run the stand-in's arithmetic on CPU
    torch.testing.assert_close(fast(x), stand_in(x), rtol=1e-5, atol=1e-4)


def test_a_killed_build_does_not_hang_later_loads(tmp_path):
    """Regression: a build killed mid-compile left torch's `lock` file behind and every later process
    waited on it forever (FileBaton.wait). kvserve's own flock makes such a lock provably stale."""
    import subprocess
    import sys

    build_dir = kernels.extension_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").write_text("")  # what a SIGKILLed build leaves
    code = "from kvserve.quant import kernels; print(kernels.kernels_available())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in {"True", "False"}
    assert not (build_dir / "lock").exists()
