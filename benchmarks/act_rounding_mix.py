"""Which linears need int8x2? KL from the exact model when each kind of linear rounds its activations
once (int8) or twice (int8x2), on a GGUF file whose matrices run on the integer panel kernel.

int8x2 costs twice int8's integer products (batches and prompts run at about half int8's speed;
docs/gguf.md) and buys KL 1e-5 instead of 3e-3 on the default model. If a few kinds of linear carried
most of int8's error, rounding only those twice would keep most of the accuracy at a fraction of the
cost. Each MIX names a rounding per kind (qkv, o, gate_up, down, head; unnamed kinds: int8x2), e.g.
`o=int8` or `qkv=int8,o=int8,gate_up=int8,down=int8,head=int8`. Every mix is scored by
kvserve/quant/compare.py against the file's blocks dequantised to fp32 (`--reference-quantization
fp32`, as benchmarks/quality_table.py) on the held-out prose and code of kvserve/assets/eval: KL mean and
p99, top-1 agreement, and the share of greedy continuations identical to the reference's.

The rounding is chosen per linear while the engine loads the file (a wrapper around
`block_weights.as_quantized_tensor`, the one place that fixes a transcoded linear's activation
rounding): the engine itself is unchanged, and `all=int8x2` is the default model's default.

    .venv/bin/python benchmarks/act_rounding_mix.py [--model FILE.gguf] "o=int8" "down=int8" ...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _report import kvserve_llm, threads_used, write_report  # benchmarks/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EVAL_DIR = ROOT / "kvserve" / "assets" / "eval"
TEXTS = ("prose", "code")
KINDS = ("qkv", "o", "gate_up", "down", "head")


def linear_kind(parts, previous: str | None) -> str:
    """Which linear of a Llama-shaped model these stacked GGUF matrices are, in the order the loader
    transcodes them (model/loader.py install_block_weights: a tied head first, then each layer's
    q, k, v stacked (3 parts), o, gate and up (2 parts), down; an untied head last): one matrix is o
    after qkv, down after gate_up, and the head anywhere else."""
    if len(parts) == 3:
        return "qkv"
    if len(parts) == 2:
        return "gate_up"
    return {"qkv": "o", "gate_up": "down"}.get(previous, "head")


def parse_mix(spec: str) -> dict[str, str]:
    mix = {}
    for item in spec.split(","):
        kind, _, rounding = item.partition("=")
        if kind == "all":
            mix.update(dict.fromkeys(KINDS, rounding))
        elif kind in KINDS and rounding in ("int8", "int8x2"):
            mix[kind] = rounding
        else:
            raise SystemExit(f"bad mix item {item!r}: KIND=int8|int8x2 with KIND in {KINDS} or all")
    return mix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mixes", nargs="+", help="e.g. o=int8 or qkv=int8,down=int8")
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or .gguf")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=None, help="first N tokens of each text")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    mixes = [(spec, parse_mix(spec)) for spec in args.mixes]
    kvserve_llm()  # kvserve's thread defaults, before torch loads

    import kvserve.model.loader as loader
    from kvserve.models import resolve_model
    from kvserve.quant.compare import EvalModel, candidate_stats, reference_run, signed_report
    from kvserve.quant.scheme import GGUF_ACTIVATION_ACTS

    chosen: dict[str, str] = {}
    seen: dict[str, set] = {}
    previous: list[str | None] = [None]
    transcode = loader.as_quantized_tensor

    def per_kind(parts, act=None):
        kind = previous[0] = linear_kind(parts, previous[0])
        if act is not None:  # the panel kernel was asked for: this kind's rounding instead
            act = GGUF_ACTIVATION_ACTS[chosen[kind]]
            seen.setdefault(kind, set()).add(chosen[kind])
        return transcode(parts, act)

    loader.as_quantized_tensor = per_kind
    model_dir = resolve_model(args.model)
    reference = EvalModel(model_dir, "fp32")
    ref = reference.load(args.num_prompts)
    runs = {
        text: reference_run(ref, EVAL_DIR / f"{text}.jsonl", window=args.window, max_tokens=args.max_tokens,
                            num_prompts=args.num_prompts, greedy_tokens=args.greedy_tokens)
        for text in TEXTS
    }  # fmt: skip
    del ref
    rows = []
    for spec, mix in mixes:
        chosen.clear()
        chosen.update(dict.fromkeys(KINDS, "int8x2") | mix)
        seen.clear()
        previous[0] = None
        start = time.perf_counter()
        candidate = EvalModel(model_dir, None, gguf_activations="int8x2")
        cand = candidate.load(args.num_prompts)
        if set(seen) != set(KINDS):
            raise SystemExit(f"the model's panel linears were {sorted(seen)}, not every kind")
        row = {"mix": spec, "rounding": dict(chosen)}
        for text, run in runs.items():
            report = signed_report(reference, candidate, candidate_stats(run, cand))
            row[text] = {
                "kl_mean": report["kl_mean"],
                "kl_p99": report["kl_p99"],
                "top1_agreement": report["top1_agreement"],
                "greedy_identical": report["greedy"]["identical_share"],
            }
        row["seconds"] = round(time.perf_counter() - start, 1)
        del cand
        rows.append(row)
        cells = [f"{t}: KL {row[t]['kl_mean']:.2e} (p99 {row[t]['kl_p99']:.2e}) top-1 "
                 f"{row[t]['top1_agreement']:.3f} greedy {row[t]['greedy_identical']:.2f}"
                 for t in TEXTS]  # fmt: skip
        print(f"| {spec} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        write_report(args.out, {
            "benchmark": "act-rounding-mix",
            "model": args.model,
            "reference": "fp32 (every weight dequantised to fp32)",
            "window": args.window,
            "num_prompts": args.num_prompts,
            "threads": threads_used(),
            "rows": rows,
        })  # fmt: skip


if __name__ == "__main__":
    main()
