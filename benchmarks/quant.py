"""Quantisation: quality per format x method on the demo target, speed beside llama.cpp.

quality: `kvserve.quant.compare` of each candidate against the fp32 demo target on held-out code and
prose (the demo corpus' held-out split of the Python standard library: documents whose
sha256(seed:key) < 3%, so disjoint from training and from the calibration text taken from the train
split): size, bits/weight of the quantised linears, perplexity, KL vs fp32, top-1 agreement.

speed: decode tok/s at batch 1 and 16 and prefill tok/s on the SmolLM2-135M-shaped checkpoint, kvserve
fp32 / int8 / int4 beside llama.cpp's f32 / Q8_0 / Q4_0 GGUFs (llama-bench, llama-batched-bench), same
threads, peer_llamacpp.py's definitions (decode tok/s excludes the prefill). Measured as llama-bench
measures: one warm-up run of the same shape, then `--repeats` runs, and the mean of their rates
(llama-bench `-r` and its `avg_ts`; the runs are in the report). llama-batched-bench runs once.

    kv-bench .venv/bin/python benchmarks/quant.py quality [--max-tokens 4096]
    kv-bench .venv/bin/python benchmarks/quant.py speed --hf-dir /tmp/kv/smol-gpt2 \
        --gguf-dir /tmp/kv --llama-bin DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

from _report import (  # benchmarks/ is on sys.path when a script runs
    kvserve_llm,
    threads_used,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUALITY = [
    ("int8", "rtn"),
    ("w8a8", "rtn"),
    ("w8a8-pt", "rtn"),
    ("int4-g32", "rtn"),
    ("int4-g64", "rtn"),
    ("int4-g128", "rtn"),
    ("int4-g128-zp", "rtn"),
    ("int4", "rtn"),
    ("int4-pt", "rtn"),
    ("mixed", "rtn"),
]
METHOD_ROWS = [("int4-g32", "gptq"), ("int4-g32", "awq"), ("w8a8-pt", "smoothquant")]
# groups no artifact of the demo can hold (its 320 / 864 inputs are not multiples of 64 or 128:
# compressed-tensors needs whole groups): quantised at load, the last group of a row short
AT_LOAD_METHOD_ROWS = [
    ("int4-g64", "gptq"),
    ("int4-g64", "awq"),
    ("int4-g128", "gptq"),
    ("int4-g128", "awq"),
]


def heldout_files(work: Path, seed: int = 1234, fraction: float = 0.03) -> dict[str, Path]:
    """Held-out code and prose (and train-split calibration text) from the demo corpus' split."""
    from tools.demo_models.corpus import in_heldout, python_stdlib_documents

    work.mkdir(parents=True, exist_ok=True)
    out = {k: work / f"{k}.jsonl" for k in ("code", "prose", "calib")}
    if all(p.is_file() for p in out.values()):
        return out
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows: dict[str, list[str]] = {"code": [], "prose": [], "calib": []}
    for doc in python_stdlib_documents(stdlib):
        if in_heldout(doc.split_key, fraction, seed):
            rows[doc.kind].append(doc.text)
        elif len(rows["calib"]) < 40 and doc.kind == "code":
            rows["calib"].append(doc.text)
    for key, texts in rows.items():
        out[key].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return out


def quality(args: argparse.Namespace) -> dict:
    from kvserve.lab.plan.formats import parse_weight_format
    from kvserve.lab.plan.model import load_model as plan_model
    from kvserve.models import default_model_dir
    from kvserve.quant.compare import compare
    from kvserve.quant.pipeline import quantize_checkpoint

    target = default_model_dir()
    files = heldout_files(Path(args.work))
    spec = plan_model(str(target))
    rows = []
    for fmt, method in [] if args.methods_only else QUALITY:
        row = {"format": fmt, "method": method}
        try:
            plan_fmt = parse_weight_format(fmt.replace("w8a8-pt", "int8").replace("w8a8", "int8"))
            row["plan_weight_bytes"] = plan_fmt.weight_bytes(spec)
            row["plan_bits_per_weight"] = plan_fmt.bits_per_weight(spec)
        except Exception as exc:  # per-tensor int4 is not a plan format
            row["plan_note"] = str(exc)
        for kind in ("code", "prose"):
            start = time.perf_counter()
            rep = compare(
                target,
                target,
                files[kind],
                cand_quantization=fmt,
                window=256,
                max_tokens=args.max_tokens,
                num_prompts=4,
                greedy_tokens=16,
            )
            row[kind] = {
                k: rep[k] for k in ("ppl_reference", "ppl_candidate", "kl_mean", "kl_p99")
            } | {
                "top1": rep["top1_agreement"],
                "greedy_identical": rep["greedy"]["identical_share"],
                "tokens": rep["num_scored_tokens"],
                "seconds": round(time.perf_counter() - start, 1),
            }
        rows.append(row)
        c, p = row["code"], row["prose"]
        print(
            f"{fmt:14s} {method:5s} code ppl {c['ppl_reference']:.3f}->{c['ppl_candidate']:.3f} "
            f"KL {c['kl_mean']:.4f} top1 {c['top1']:.3f} | prose ppl {p['ppl_reference']:.3f}->"
            f"{p['ppl_candidate']:.3f} KL {p['kl_mean']:.4f} top1 {p['top1']:.3f}",
            flush=True,
        )
    # calibrated methods, through written artifacts (the demo's 864-wide MLP allows only g32 there),
    # then the larger groups quantised at load from the same calibration text
    for fmt, method in METHOD_ROWS + AT_LOAD_METHOD_ROWS:
        if (fmt, method) in METHOD_ROWS:
            out = Path(args.work) / f"{fmt}-{method}"
            report = quantize_checkpoint(
                target, out, weights=fmt, method=method, calib=str(files["calib"]),
                calib_tokens=4096,
            )  # fmt: skip
            row = {"format": fmt, "method": method, "artifact_sha256": report["artifact_sha256"]}
            candidate = {}
        else:
            out = target
            row = {"format": fmt, "method": method, "at_load": True}
            candidate = dict(
                cand_quantization=fmt, cand_method=method, cand_calib=str(files["calib"])
            )
        for kind in ("code", "prose"):
            rep = compare(target, out, files[kind], window=256, max_tokens=args.max_tokens,
                          num_prompts=4, greedy_tokens=16, **candidate)  # fmt: skip
            row[kind] = {
                k: rep[k] for k in ("ppl_reference", "ppl_candidate", "kl_mean", "kl_p99")
            } | {"top1": rep["top1_agreement"], "tokens": rep["num_scored_tokens"]}
        rows.append(row)
        c, p = row["code"], row["prose"]
        print(
            f"{fmt:14s} {method:11s} code ppl {c['ppl_candidate']:.3f} KL {c['kl_mean']:.4f} "
            f"top1 {c['top1']:.3f} | prose ppl {p['ppl_candidate']:.3f} KL {p['kl_mean']:.4f} "
            f"top1 {p['top1']:.3f}",
            flush=True,
        )
    return {"benchmark": "quant-quality", "target": str(target), "rows": rows}


def kvserve_repeated(llm, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """`kvserve_point` as llama-bench times a test: a warm-up run of the same shape (not counted),
    then `repeats` runs; rates are the mean of the runs' rates, each run's rate kept."""
    from peer_llamacpp import kvserve_point

    kvserve_point(llm, batch, prompt_len, new_tokens)  # warm-up: the same shape, not counted
    runs = [kvserve_point(llm, batch, prompt_len, new_tokens) for _ in range(repeats)]
    out = {"batch": batch, "repeats": repeats}
    for key in ("prefill_tok_s", "decode_tok_s"):
        values = [r[key] for r in runs]
        out[key] = sum(values) / len(values)
        out[f"{key}_runs"] = [round(v, 2) for v in values]
    return out


def speed(args: argparse.Namespace) -> dict:
    LLM = kvserve_llm()  # before torch: kvserve's thread defaults apply as they do for users
    import torch
    from peer_llamacpp import llama_batched_bench, llama_bench

    from kvserve.model import fused_decode

    torch.set_num_threads(args.threads)
    if args.isa:
        from kvserve.model.kernel_choice import set_max_isa

        set_max_isa(args.isa)  # cap the native kernels' instruction set (an A B of two levels)
    peers = {"fp32": "f32", "int8": "Q8_0", "linear=int8,head=int8": "Q8_0"}
    peers |= {"int4-g32": "Q4_0", "linear=int4-g32,head=int8": "Q4_0"}
    # bf16 products: llama.cpp's BF16 GGUF (convert_hf_to_gguf.py --outtype bf16) runs the same ones
    peers |= {"linear=bf16,head=bf16": "BF16"}
    rows = []
    bin_dir = Path(args.llama_bin) if args.llama_bin else None
    for fmt in args.formats.split(";"):
        quant = None if fmt == "fp32" else fmt
        llm = LLM(args.hf_dir, quantization=quant, max_num_seqs=64)
        for batch in args.batches:
            ours = kvserve_repeated(llm, batch, args.prompt_len, args.new_tokens, args.repeats)
            row = {"format": fmt, "batch": batch, "kvserve": ours}
            gguf = Path(args.gguf_dir) / f"smol-gpt2-{peers.get(fmt, 'f32')}.gguf"
            if bin_dir is not None and (bin_dir / "llama-bench").is_file() and gguf.is_file():
                if batch == 1:
                    theirs = llama_bench(
                        str(bin_dir / "llama-bench"), str(gguf), args.threads,
                        args.prompt_len, args.new_tokens, args.repeats,
                    )  # fmt: skip
                else:
                    theirs = llama_batched_bench(
                        str(bin_dir / "llama-batched-bench"), str(gguf), args.threads, batch,
                        args.prompt_len, args.new_tokens,
                    )  # fmt: skip
                row["llama.cpp"] = {"gguf": gguf.name, **theirs}
                row["decode_ratio"] = ours["decode_tok_s"] / theirs["decode_tok_s"]
            rows.append(row)
            peer = row.get("llama.cpp", {})
            print(
                f"{fmt:26s} batch {batch:2d}: decode {ours['decode_tok_s']:7.1f} tok/s "
                f"(runs {ours['decode_tok_s_runs']}), prefill "
                f"{ours['prefill_tok_s']:7.1f}; llama.cpp {peer.get('gguf', '-')} decode "
                f"{peer.get('decode_tok_s', float('nan')):7.1f} prefill "
                f"{peer.get('prefill_tok_s', float('nan')):7.1f}",
                flush=True,
            )
        del llm
    return {
        "benchmark": "quant-speed",
        "hf_dir": args.hf_dir,
        "threads": args.threads,
        "kvserve_threads": threads_used(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "isa": fused_decode.isa(),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens per kind")
    q.add_argument("--work", default="/tmp/kvserve-quant-bench")
    q.add_argument("--out", default="benchmarks/results/quant_quality.json")
    q.add_argument("--methods-only", action="store_true", help="only the calibrated rows")
    s = sub.add_parser("speed")
    s.add_argument("--hf-dir", default="/tmp/kv/smol-gpt2")
    s.add_argument("--gguf-dir", default="/tmp/kv")
    s.add_argument("--llama-bin", default=None, help="directory with llama-bench")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode batch sizes")
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per point after a warm-up (llama-bench -r)",
    )
    s.add_argument(
        "--formats", default="fp32;int8;linear=int8,head=int8;int4-g32;linear=int4-g32,head=int8"
    )
    s.add_argument("--isa", default=None, help="cap the native kernels: avx512, avx2 or scalar")
    s.add_argument("--out", default="benchmarks/results/quant_speed.json")
    args = parser.parse_args()
    report = quality(args) if args.what == "quality" else speed(args)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
