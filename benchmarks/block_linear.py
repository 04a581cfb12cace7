"""GGUF block linears (kvserve/model/block_linear.py) against fp32 torch.matmul, on SmolLM2-135M's Q4_1
layers and Q8_0 head (real weights). Methods, alternated round by round (A B C, then C B A, ...):
  kernel      csrc/blocks.c block_linear on the repacked blocks
  dq_matmul   BlockLinear's large-T path: chunks of rows dequantised (block_dequant_rows) + torch.matmul
  fp32        torch.matmul by a weight dequantised once and held in fp32 (4 bytes a weight)
Median ms per call; GB/s = the repacked weight's bytes / the kernel's time.

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/block_linear.py [--rows 1,4,16,128]
        [--rounds 7] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.model import block_linear  # noqa: E402
from kvserve.model.block_weights import repack  # noqa: E402
from tests.gguf_tensors import read_tensors  # noqa: E402

MODEL = Path("/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf")
TENSORS = {  # label: tensor name
    "Q4_1 576x1536 (down)": "blk.0.ffn_down.weight",
    "Q4_1 1536x576 (up)": "blk.0.ffn_up.weight",
    "Q8_0 49152x576 (head)": "token_embd.weight",
}


def time_call(fn, min_s: float = 0.05) -> float:
    """Seconds per call: repeat until min_s has passed (at least 2 calls)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 2 and elapsed >= min_s:
            return elapsed / calls


def bench(weight, num_tokens: int, rounds: int) -> dict:
    x = torch.randn(num_tokens, weight.num_cols)
    y = torch.empty(num_tokens, weight.num_rows)
    dense = weight.dequantize()
    methods = {
        "kernel": lambda: block_linear.linear_into(weight, x, y),
        "dq_matmul": lambda: block_linear.dequant_matmul_into(weight, x, y, native=True),
        "fp32": lambda: torch.matmul(x, dense.t()),
    }
    times = {name: [] for name in methods}
    for r in range(rounds):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in order:
            times[name].append(time_call(methods[name]))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "rows": num_tokens,
        **{f"{name}_ms": round(v, 4) for name, v in ms.items()},
        "kernel_weight_GBps": round(weight.bytes / (ms["kernel"] * 1e-3) / 1e9, 2),
        "fp32_weight_GBps": round(dense.numel() * 4 / (ms["fp32"] * 1e-3) / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tensors = {t.name: t for t in read_tensors(MODEL)}
    report = {
        "threads": torch.get_num_threads(),
        "isa": block_linear.BlockLinear([repack(tensors[TENSORS["Q4_1 1536x576 (up)"]].data,
                                                "Q4_1", (1536, 576))]).kernel,
        "load_average_start": os.getloadavg(),
        "results": {},
    }  # fmt: skip
    for label, name in TENSORS.items():
        tensor = tensors[name]
        weight = repack(tensor.data, tensor.ggml_type, tensor.torch_shape)
        rows = []
        for num_tokens in map(int, args.rows.split(",")):
            rows.append(bench(weight, num_tokens, args.rounds))
            print(label, rows[-1], flush=True)
        report["results"][label] = {"weight_bytes": weight.bytes, "rows": rows}
    report["load_average_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
