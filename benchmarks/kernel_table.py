"""The per-shape GEMM table (kvserve/model/kernel_table.py) on this machine, and what it changes end to end.

1. The table: for every linear shape of a model, kvserve's own kernel vs torch's candidates at row
   buckets 1 .. 512 (seconds per call, alternated, minimum of `--rounds`), measured by the engine's
   own `remeasure` with a budget large enough to cover every shape; plus the stand-alone 192x576 (k or
   v alone) and 1536x576 (gate or up alone) fp32 shapes that kvserve serves fused.
2. End to end, the measured choice (`--kernel-choice measured`, from the timings just cached) vs the
   previous fixed rules (`own`), alternated A B A B in one process: a 512-token prompt's prefill
   (max_tokens 1) and batch-16 decode (16 prompts of 16 tokens, 64 tokens each, EOS ignored), with the
   greedy tokens of both compared.

Models: the GGUF Q4_1 SmolLM2-135M-Instruct file (kvserve's default model), and a random fp32
checkpoint of SmolLM2-135M's shape (benchmarks/decode.py).

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/kernel_table.py \
        --out benchmarks/results/zen3_avx2/session_1207/kernel_table.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _report import write_report  # benchmarks/ is on sys.path when a script runs

GGUF = "/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def standalone_fp32(rounds: int) -> dict:
    """192x576 and 1536x576 fp32 as PackedLinears of their own (kvserve fuses them into 960x576
    and 3072x576)."""
    import torch

    from kvserve.model import kernel_table
    from kvserve.model.linear import PackedLinear

    out = {}
    gen = torch.Generator().manual_seed(0)
    for n, k in ((192, 576), (1536, 576)):
        module = PackedLinear(torch.randn(n, k, generator=gen) * 0.05, None)
        cands = kernel_table.candidates_of(module)
        runners = {cands.own: kernel_table._own_runner(module)}
        runners |= {name: build()[0] for name, build in cands.builders.items()}
        got = kernel_table.measure(module, runners, time.perf_counter() + 120)
        out[f"{n}x{k}/f32"] = {str(r): t for r, t in got.items()}
    return out


def time_prefill(llm, prompt: list[int]) -> tuple[float, list[int]]:
    from kvserve import SamplingParams

    llm.engine.kv_manager.pool.reset_prefix_cache()
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - start, list(out[0].outputs[0].token_ids)


def time_decode(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from kvserve import SamplingParams

    llm.engine.kv_manager.pool.reset_prefix_cache()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in out]


def end_to_end(model: str, vocab: int, repeats: int) -> dict:
    """own vs measured, alternated; the measured engine's table re-timed first (remeasure)."""
    import torch

    from kvserve import LLM
    from kvserve.model import kernel_table

    options = dict(max_num_seqs=32, kv_cache_memory_bytes=512 * 2**20, thread_policy="fixed")
    engines = {
        "own": LLM(model, kernel_choice="own", **options),
        "measured": LLM(model, kernel_choice="measured", **options),
    }
    measured_model = engines["measured"].engine.runner.model
    start = time.perf_counter()
    table = kernel_table.apply_kernel_choice(measured_model, "remeasure", budget_s=300.0)
    measure_s = time.perf_counter() - start
    measured_model.kernel_table = table
    timings = kernel_table._read_cache()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (512,), generator=gen).tolist()
    prompts = torch.randint(3, vocab, (16, 16), generator=gen).tolist()
    runs: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in engines}
    tokens: dict[str, dict[str, list]] = {n: {} for n in engines}
    for llm in engines.values():  # warm-up: first calls, oneDNN primitives
        time_prefill(llm, prompt[:64])
        time_decode(llm, prompts[:2], 4)
    for _ in range(repeats):
        for name, llm in engines.items():
            elapsed, tokens[name]["prefill"] = time_prefill(llm, prompt)
            runs[name]["prefill"].append(elapsed)
            elapsed, tokens[name]["decode"] = time_decode(llm, prompts, 64)
            runs[name]["decode"].append(elapsed)
    result = {
        "model": model,
        "table": table,
        "timings_s": {k: timings[k] for k in table if k in timings},
        "remeasure_s": measure_s,
        "runs_s": runs,
        "prefill_512_tokens_per_s": {n: 512 / min(r["prefill"]) for n, r in runs.items()},
        "decode_b16_tokens_per_s": {n: 16 * 64 / min(r["decode"]) for n, r in runs.items()},
        "same_greedy_tokens": {
            part: tokens["own"][part] == tokens["measured"][part] for part in ("prefill", "decode")
        },
    }
    result["ratio_measured_over_own"] = {
        "prefill": result["prefill_512_tokens_per_s"]["measured"]
        / result["prefill_512_tokens_per_s"]["own"],
        "decode_b16": result["decode_b16_tokens_per_s"]["measured"]
        / result["decode_b16_tokens_per_s"]["own"],
    }
    print(model, {k: result[k] for k in ("prefill_512_tokens_per_s", "decode_b16_tokens_per_s")})
    print("  ratio", result["ratio_measured_over_own"], "same", result["same_greedy_tokens"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kernel_table.json")
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs per engine")
    parser.add_argument("--models", default="gguf,fp32")
    args = parser.parse_args()
    load_before = os.getloadavg()

    import torch

    from kvserve.model.kernel_choice import probe_matrix_engine

    report = {
        "benchmark": "kernel_table",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "matrix_engine": probe_matrix_engine().summary(),
        "load_average_before": load_before,
        "standalone_fp32_timings_s": standalone_fp32(3),
        "models": {},
    }
    models = args.models.split(",")
    if "gguf" in models:
        report["models"]["gguf_q4_1"] = end_to_end(GGUF, 49152, args.repeats)
    if "fp32" in models:
        from decode import build

        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp))
            report["models"]["fp32_random_smollm2_shape"] = end_to_end(tmp, 49152, args.repeats)
    report["load_average_after"] = os.getloadavg()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
