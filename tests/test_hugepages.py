"""The kernels' weight layouts on huge-page-advised memory (kvserve/model/hugepages.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from kvserve.model import fused_decode, hugepages
from kvserve.model.linear import PackedLinear
from kvserve.model.qlinear import pack_panels
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import parse_tensor_scheme

pytestmark = pytest.mark.skipif(not hugepages.enabled(), reason="Linux with madvise only")


def _advised(t: torch.Tensor) -> bool:
    """Whether t's first byte lies in a mapping advised MADV_HUGEPAGE ('hg' in its VmFlags)."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()
    return False


def test_tensors_are_line_aligned_advised_and_hold_their_values():
    small = [hugepages.to_huge_pages(torch.arange(n, dtype=torch.float32)) for n in (1, 17, 1000)]
    codes = hugepages.to_huge_pages(torch.arange(-50, 50, dtype=torch.int8).view(10, 10))
    big = hugepages.huge_empty((hugepages.ARENA_BYTES // 4,), torch.float32)  # its own mapping
    big.fill_(3.0)
    for n, t in zip((1, 17, 1000), small, strict=True):
        assert torch.equal(t, torch.arange(n, dtype=torch.float32)) and t.is_contiguous()
    assert torch.equal(codes, torch.arange(-50, 50, dtype=torch.int8).view(10, 10))
    assert all(t.data_ptr() % 64 == 0 for t in (*small, codes, big))
    assert big.data_ptr() % hugepages.HUGE_PAGE == 0
    assert all(_advised(t) for t in (*small, codes, big))
    assert not _advised(torch.ones(1 << 20))  # torch's own allocation: not advised
    rss, huge = hugepages.resident()
    assert rss >= big.numel() * 4 and 0 <= huge <= rss  # huge pages are the kernel's to grant
    assert "kernel layouts on huge pages: " in hugepages.describe()


def test_the_kernels_weight_layouts_are_advised_and_unchanged():
    torch.manual_seed(0)
    weight = torch.randn(40, 64)
    linear = PackedLinear(weight, None)
    if linear.panels is None:
        pytest.skip("no C kernels here")
    assert _advised(linear.panels)
    assert torch.equal(linear.panels, fused_decode.f32_panels(weight).clone())
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    for name in ("int8", "int4-g32", "int4-g32-zp"):
        packed = pack_panels(quantize(weight, parse_tensor_scheme(name)))
        assert _advised(packed["w"]) and _advised(packed["scales"])
        assert packed["zeros"] is None or _advised(packed["zeros"])


def test_switched_off_by_the_environment():
    code = (
        "import torch; from kvserve.model import hugepages as h; "
        "t = h.to_huge_pages(torch.ones(4)); print(h.enabled(), h.describe(), t.sum().item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={"KVSERVE_HUGE_PAGES": "0", "PATH": ""},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert (
        out.split() == "False kernel layouts on ordinary pages (KVSERVE_HUGE_PAGES=0) 4.0".split()
    )
