"""bf16 products against fp32 panels and torch's own bf16 linear (oneDNN), one linear at a time.

For SmolLM2-135M's shapes (N x K: qkv 960 x 576, gate/up 3072 x 576, down 576 x 1536) and row counts
from a batch-1 decode to a long prompt step: GFLOP/s of
- `fp32`: `PackedLinear` on fp32 panels (the default, exact fp32);
- `bf16`: `PackedLinear(bf16_products=True)` (csrc/bf16dot.c: vdpbf16ps where the CPU has it);
- `torch-bf16`: `F.linear` on bf16 tensors (oneDNN; rounds its output to bf16 as well), the rate a
  bf16 engine built on torch gets (vLLM's CPU build);
each the best of `--passes` passes, the variants alternated within a pass. Weights are distinct per
call (`--layers` copies, cycled) so that small row counts read them from memory as a model does.

    .venv/bin/python benchmarks/bf16_products.py --out benchmarks/results/bf16_products.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = [(960, 576), (3072, 576), (576, 1536)]
ROWS = [1, 4, 16, 48, 128, 512, 2048]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--layers", type=int, default=8, help="distinct weights per shape")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/bf16_products.json"))
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from kvserve.model import fused_decode
    from kvserve.model.linear import PackedLinear

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for n, k in SHAPES:
        weights = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(args.layers)]
        variants = {
            "fp32": [PackedLinear(w, None) for w in weights],
            "bf16": [PackedLinear(w, None, bf16_products=True) for w in weights],
            "torch-bf16": [partial(F.linear, weight=w.to(torch.bfloat16)) for w in weights],
        }
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            inputs = {"fp32": x, "bf16": x, "torch-bf16": x.to(torch.bfloat16)}
            calls = max(args.layers, int(4e8 / (m * n * k)) // args.layers * args.layers)
            best = {}
            for _ in range(args.passes):
                for name, mods in variants.items():
                    for mod in mods:  # warm
                        mod(inputs[name])
                    t = time.perf_counter()
                    for i in range(calls):
                        mods[i % args.layers](inputs[name])
                    rate = 2 * m * n * k * calls / (time.perf_counter() - t) / 1e9
                    best[name] = max(best.get(name, 0.0), rate)
            row = {"n": n, "k": k, "rows": m, "gflops": best}
            row["bf16_over_fp32"] = best["bf16"] / best["fp32"]
            row["bf16_over_torch_bf16"] = best["bf16"] / best["torch-bf16"]
            rows_out.append(row)
            print(
                f"{n:5d} x {k:4d}, {m:4d} rows: fp32 {best['fp32']:6.1f}  bf16 {best['bf16']:6.1f}  "
                f"torch-bf16 {best['torch-bf16']:6.1f} GFLOP/s  bf16/fp32 {row['bf16_over_fp32']:.2f}",
                flush=True,
            )
    result = {
        "benchmark": "bf16-products",
        "threads": args.threads,
        "isa": fused_decode.isa(),
        "vdpbf16ps": fused_decode.bf16_insn(),
        "torch": torch.__version__,
        "rows": rows_out,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
