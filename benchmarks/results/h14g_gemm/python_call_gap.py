"""small_linear from Python: allocated output, preallocated output, 1 thread, beside oneDNN (h14g).

Ran on the tree before the kernel fix (d76c2e8), where PackedLinear still held `packed`, oneDNN's copy.
The gap to the C microbenchmark was noise: h.c, the same call from C, ran as slowly.
"""

import ctypes
import time

import torch

from kvserve.model import cpu_kernels, fused_decode
from kvserve.model.linear import PackedLinear

lib = cpu_kernels.load_kernel()
print("threads", torch.get_num_threads(), flush=True)
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
n = 30
mods = [[PackedLinear(torch.randn(o, i), None) for (o, i) in shapes] for _ in range(n)]


def bench(M, mode):
    xs = {i: torch.randn(M, i) for (_, i) in shapes}
    ys = {o: torch.empty(M, o) for (o, _) in shapes}

    def once():
        for layer in mods:
            for (o, i), m in zip(shapes, layer, strict=False):
                if mode == "panel":
                    fused_decode.small_linear(m._desc, xs[i])
                elif mode == "prealloc":
                    lib.small_linear(
                        ctypes.byref(m._desc), xs[i].data_ptr(), M, ys[o].data_ptr(), 2
                    )
                elif mode == "1thr":
                    lib.small_linear(
                        ctypes.byref(m._desc), xs[i].data_ptr(), M, ys[o].data_ptr(), 1
                    )
                else:
                    torch.ops.mkldnn._linear_pointwise(xs[i], m.packed, None, "none", [], "")

    once()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t)
    t = sorted(ts)[2]
    return t * 1e3, 2 * M * sum(o * i for o, i in shapes) * n / t / 1e9


for M in (16, 64):
    for mode in ("onednn", "panel", "prealloc", "1thr") * 2:
        ms, gf = bench(M, mode)
        print(f"M={M:3d} {mode:9s}: {ms:7.1f} ms / 30 layers, {gf:6.1f} GFLOP/s", flush=True)
