"""Batch-1 decode against the machine's read roof, per weight format (issue 48's goal: >= 0.9).

Per round, alternating the formats' order (A B C, then C B A):
- the roof: the best of 5 reads of a 1 GiB fp32 buffer (`torch.sum`, on the threads the engine
  uses), in GB/s, measured in this run beside the engine's steps;
- for each format, the batch-1 step: (time of 65 greedy tokens - time of 1 token) / 64 on a
  64-token prompt, the offline engine (`LLM`), prefill excluded;
- the weight bytes one step reads: every linear's weight as the engine holds it for the CPU
  kernels (panels, integer codes and their scales, GGUF blocks), the LM head included, each
  tensor counted once (a tied embedding reads one row of the head's weight: not counted again).
The fraction of the roof is bytes / step time / roof.

Formats: `fp32`, kvserve's `--quantization` strings (`linear=int8,head=int8`, ...), and GGUF files
as shipped (`gguf:PATH[:MODE]`, MODE one of `--gguf-activations`' int8, int8x2, fp32; without it
fp32, the exact products). The random checkpoint has
SmolLM2-135M's shape (benchmarks/decode.py builds it).

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/read_roof.py --rounds 2 \
        [--formats "fp32;linear=int8,head=int8;gguf:/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvserve  # noqa: E402,F401,I001  (its thread defaults before torch loads)
import torch  # noqa: E402

SMOLLM2 = "/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FORMATS = ";".join(
    [
        "fp32",
        "linear=bf16",
        "linear=int8,head=int8",
        "linear=int4-g32,head=int8",
        f"gguf:{SMOLLM2}",
        f"gguf:{SMOLLM2}:int8",
    ]
)


def read_roof_gbs(repeats: int = 5) -> float:
    """The best of `repeats` full reads of a 1 GiB fp32 buffer, GB/s."""
    buf = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def _tensor_bytes(seen: set[int], *tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def step_weight_bytes(model: torch.nn.Module) -> int:
    """The weight bytes one decode step reads: each linear's weight as the kernels read it."""
    from kvserve.model.block_linear import BlockLinear
    from kvserve.model.linear import PackedLinear
    from kvserve.model.qlinear import QuantLinear

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, BlockLinear):
            for part in module.parts:
                total += _tensor_bytes(seen, *vars(part).values())
            total += _tensor_bytes(seen, module.bias)
        elif isinstance(module, QuantLinear):
            total += _tensor_bytes(seen, module.w, module.scales, module.zeros, module.bias)
            total += _tensor_bytes(seen, module.weight_deq)
        elif isinstance(module, PackedLinear):
            panels = module.panels
            if panels is None:
                panels = getattr(module, "weight_bf16", None)
            if panels is None:  # oneDNN's opaque layout: fp32, out x in
                total += module.out_features * module.in_features * 4
            total += _tensor_bytes(seen, panels, module.bias)
        elif isinstance(module, torch.nn.Linear):
            total += _tensor_bytes(seen, module.weight, module.bias)
    return total


def engine_for(fmt: str, hf_dir: Path):
    from kvserve import LLM

    options = dict(max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=256 << 20)
    if fmt.startswith("gguf:"):
        path, _, acts = fmt[len("gguf:") :].partition(":")
        return LLM(path, gguf_activations=acts or "fp32", **options)
    return LLM(str(hf_dir), quantization=None if fmt == "fp32" else fmt, **options)


def step_ms(llm) -> float:
    from kvserve import SamplingParams

    prompt = [list(range(1000, 1064))]

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt, params)
        return time.perf_counter() - start

    timed(4)  # warm-up
    best = min((timed(65) - timed(1)) / 64 for _ in range(2))
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default=DEFAULT_FORMATS, help="';'-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/read_roof.json"))
    args = p.parse_args()
    from decode import build

    formats = [f for f in args.formats.split(";") if f]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "smollm2-shape"
        build(hf_dir)
        for r in range(args.rounds):
            order = formats if r % 2 == 0 else formats[::-1]
            row = {"roof_gbs_before": read_roof_gbs(), "load": os.getloadavg()[0]}
            for fmt in order:
                llm = engine_for(fmt, hf_dir)
                model = llm.engine.runner.model
                ms = step_ms(llm)
                nbytes = step_weight_bytes(model)
                row[fmt] = {"step_ms": ms, "weight_mb": nbytes / 1e6, "gbs": nbytes / ms / 1e6}
                del llm
            row["roof_gbs_after"] = read_roof_gbs()
            roof = max(row["roof_gbs_before"], row["roof_gbs_after"])
            for fmt in formats:
                row[fmt]["of_roof"] = row[fmt]["gbs"] / roof
                print(f"round {r} {fmt:60s} {row[fmt]['step_ms']:7.2f} ms "
                      f"{row[fmt]['weight_mb']:7.1f} MB {row[fmt]['gbs']:6.1f} GB/s "
                      f"{row[fmt]['of_roof']:.2f} of {roof:.1f}")  # fmt: skip
            rounds.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
