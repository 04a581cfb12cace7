"""fp32 panel GEMM variants vs oneDNN, alternated in one process (h14g microbenchmark).

Variants: "panel" (small_linear, the fp32 panel GEMM as built), "dnn" (oneDNN, packed). At
commit bf5ae21 (branch h14g) the kernel had tuning knobs (decode_set_f32_tuning): "t4" / "t6" = row
tiles of 4 / 6, "k128" = inputs blocked by 128 (panel-major), "k128o" = blocked, block-major; those
names need that commit.

Each pass runs `--layers` distinct layers of SmolLM2-135M's shapes (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; ~13 MB a layer, so 8 layers do not fit in L3), 2 threads;
GFLOP/s of the best of `--reps` passes per variant, variants interleaved pass by pass.
"""

import argparse
import ctypes
import json
import time

import torch

import kvserve  # noqa: F401  (thread defaults)
from kvserve.model import cpu_kernels
from kvserve.model.linear import PackedLinear

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256, 512])
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--variants", nargs="+", default=["panel", "dnn"])
ap.add_argument("--json")
args = ap.parse_args()
lib = cpu_kernels.load_kernel()
tune = getattr(lib, "decode_set_f32_tuning", None)
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
weights = [[torch.randn(o, i) * 0.05 for o, i in shapes] for _ in range(args.layers)]
mods = [[PackedLinear(w, None) for w in layer] for layer in weights]
# oneDNN's blocked copy, as PackedLinear made it before it kept the panels only
dnn = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer] for layer in weights]
del weights
threads = torch.get_num_threads()


def parse(v):
    tile = int(v[1]) if v.startswith("t") else 0
    kc = int(v.split("k")[1].rstrip("o")) if "k" in v else 0
    return tile, kc, int(v.endswith("o"))


def one_pass(v, xs, ys):
    if v not in ("dnn", "panel"):
        tune(*parse(v))
    t = time.perf_counter()
    for layer, dnn_layer in zip(mods, dnn, strict=True):
        for (o, i), m, packed in zip(shapes, layer, dnn_layer, strict=True):
            if v == "dnn":
                torch.ops.mkldnn._linear_pointwise(xs[i], packed, None, "none", [], "")
            else:
                lib.small_linear(
                    ctypes.byref(m._desc),
                    xs[i].data_ptr(),
                    xs[i].shape[0],
                    ys[o].data_ptr(),
                    threads,
                )
    return time.perf_counter() - t


results = []
for M in args.rows:
    xs = {i: torch.randn(M, i) for _, i in shapes}
    ys = {o: torch.empty(M, o) for o, _ in shapes}
    best = {v: 1e9 for v in args.variants}
    for v in args.variants:
        one_pass(v, xs, ys)
    for _ in range(args.reps):
        for v in args.variants:
            best[v] = min(best[v], one_pass(v, xs, ys))
    flop = 2 * M * sum(o * i for o, i in shapes) * args.layers
    row = {"rows": M, **{v: round(flop / best[v] / 1e9, 1) for v in args.variants}}
    results.append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
if args.json:
    json.dump(
        {"threads": threads, "layers": args.layers, "gflops": results},
        open(args.json, "w"),
        indent=1,
    )
