"""`kvserve eval perplexity`: held-out perplexity of a model through the engine's own forward pass."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvserve.config import GGUF_ACTIVATIONS, KV_CACHE_DTYPES
from kvserve.quant.methods import DEFAULT_METHOD


def _at_least(low: int):
    """argparse type: an integer >= low, checked before the model loads (--max-tokens 0 or -100
    would silently score every token or drop the last 100)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def register(subparsers) -> None:
    """Long: the `eval` sub-commands' flags, one declaration each."""
    parser = subparsers.add_parser("eval", help="evaluate a model (perplexity, compare)")
    sub = parser.add_subparsers(dest="eval_command", metavar="EVAL")
    ppl = sub.add_parser(
        "perplexity",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="exp(mean NLL) over fixed windows of held-out text",
        description="Held-out perplexity: documents joined as BOS text EOS, cut into fixed "
        "non-overlapping windows; exp(total NLL / scored tokens), never a mean of window perplexities.",
    )
    ppl.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory, GGUF file, or a built-in name (default: smollm2-135m-instruct)",
    )
    ppl.add_argument(
        "--data",
        required=True,
        help='.jsonl with one {"text": "..."} object per line (documents), or a plain-text file',
    )
    ppl.add_argument("--window", type=_at_least(2), default=512, help="window length in tokens")
    ppl.add_argument(
        "--max-tokens", type=_at_least(1), default=None, help="use only the first N tokens"
    )
    ppl.add_argument("--unigram-train", default=None, help="fit a unigram baseline on this file")
    ppl.add_argument("--json", default=None, help="write the result as JSON to this file")
    ppl.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ppl.set_defaults(func=run_perplexity)
    cmp = sub.add_parser(
        "compare",
        help="a candidate (e.g. quantised) model against its reference: ppl, KL, top-1, greedy",
        description="Perplexity of both, KL(p_ref || p_cand) per position (mean, p99), top-1 "
        "agreement and the first greedy difference per prompt, on the same windows "
        "(docs/quantization.md). The report names both models' artifact hashes.",
    )
    cmp.add_argument("reference", help="reference model directory")
    cmp.add_argument(
        "candidate",
        help="candidate model directory (a quantised artifact, or "
        "the reference itself with --candidate-quantization)",
    )
    cmp.add_argument("--data", required=True, help=".jsonl with a 'text' field, or a text file")
    cmp.add_argument(
        "--reference-quantization",
        default=None,
        help="quantise (or dequantise) the reference at load; fp32 on a GGUF model: every block "
        "dequantised to fp32, the reference for the file's own blocks and their requantisations",
    )
    cmp.add_argument(
        "--candidate-quantization", default=None, help="quantise the candidate at load"
    )
    cmp.add_argument(
        "--candidate-method",
        default=DEFAULT_METHOD,
        help="method of --candidate-quantization: rtn, gptq, awq, smoothquant",
    )
    cmp.add_argument(
        "--candidate-calib", default=None, help="calibration text for --candidate-method"
    )
    cmp.add_argument(
        "--candidate-kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the candidate's KV cache: the model's dtype (auto), or 8-bit codes (int8, fp8 e4m3) "
        "with an fp16 scale per token and head; the reference keeps the model's dtype",
    )
    cmp.add_argument(
        "--candidate-gguf-activations",
        default="fp32",
        choices=[a for a in GGUF_ACTIVATIONS if a != "auto"],  # the candidate is named exactly
        help="a GGUF candidate's products: fp32, or int8 activations on the panel kernel "
        "(docs/gguf.md)",
    )
    cmp.add_argument("--window", type=_at_least(2), default=256, help="window length in tokens")
    cmp.add_argument(
        "--max-tokens", type=_at_least(1), default=None, help="use only the first N tokens"
    )
    cmp.add_argument("--num-prompts", type=_at_least(1), default=8, help="greedy-agreement prompts")
    cmp.add_argument(
        "--greedy-tokens", type=_at_least(1), default=32, help="greedy tokens compared per prompt"
    )
    cmp.add_argument("--max-kl-mean", type=float, default=None, help="pass bound on mean KL")
    cmp.add_argument("--min-top1", type=float, default=None, help="pass bound on top-1 agreement")
    cmp.add_argument("--max-ppl-ratio", type=float, default=None, help="pass bound on ppl ratio")
    cmp.add_argument("--json", default=None, help="write the report to this file")
    cmp.add_argument(
        "--record",
        action="store_true",
        help="also write the report into the candidate directory (/manifest shows its hash)",
    )
    cmp.set_defaults(func=run_compare)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def run_perplexity(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from kvserve.cli.progress import progress
    from kvserve.engine.llm import LLM
    from kvserve.evaluation import (
        fixed_windows,
        perplexity,
        read_documents,
        token_stream,
        unigram_nll,
    )

    documents = read_documents(args.data)  # before the model loads: a bad file fails at once
    llm = LLM(args.model, device=args.device)
    if llm.tokenizer is None:
        print("kvserve eval: error: the model has no tokenizer", file=sys.stderr)
        return 2
    if args.window > llm.engine.max_model_len:
        print(
            f"kvserve eval: error: --window {args.window} exceeds the model's context "
            f"{llm.engine.max_model_len}",
            file=sys.stderr,
        )
        return 2
    ids = token_stream(llm.tokenizer, documents)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    windows = fixed_windows(ids, args.window)
    if not windows:
        print(f"kvserve eval: error: {args.data} holds fewer than 2 tokens", file=sys.stderr)
        return 2
    start = time.perf_counter()
    total_nll, num_scored = 0.0, 0
    for window in progress(windows, len(windows), "perplexity"):
        logits = llm.engine.score(list(window))  # [T, V] through the paged cache
        targets = torch.tensor(window[1:])
        total_nll += F.cross_entropy(logits[:-1], targets, reduction="sum").item()
        num_scored += len(window) - 1
    result = {
        "model": llm.engine.config.model_dir,
        "data": args.data,
        "window": args.window,
        "num_tokens": len(ids),
        "num_windows": len(windows),
        "num_scored_tokens": num_scored,
        "nll": total_nll / num_scored,
        "ppl": perplexity(total_nll, num_scored),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if args.unigram_train:
        train_ids = token_stream(llm.tokenizer, read_documents(args.unigram_train))
        nll, count = unigram_nll(train_ids, windows, llm.engine.config.model.vocab_size)
        result["unigram"] = {
            "train": args.unigram_train,
            "nll": nll / count,
            "ppl": perplexity(nll, count),
        }
    line = f"perplexity {result['ppl']:.3f} over {num_scored:,d} tokens ({len(windows)} windows of {args.window})"
    if "unigram" in result:
        line += f"; unigram baseline {result['unigram']['ppl']:.3f}"
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from kvserve.core.errors import InvalidRequestError, KVServeError
    from kvserve.models import builtin_name, resolve_model
    from kvserve.quant.compare import Thresholds, compare
    from kvserve.quant.provenance import EVALUATION_NAME

    try:
        reference, candidate = resolve_model(args.reference), resolve_model(args.candidate)
        # --record writes into the candidate's directory: not into the installed package,
        # and not into a float model that is quantised only at load (its report is not the dir's)
        if args.record and builtin_name(candidate):
            raise InvalidRequestError(
                f"--record would write into the built-in {args.candidate!r}: copy it first",
                "record",
            )
        at_load = [
            flag
            for flag, given in (
                ("--candidate-quantization", args.candidate_quantization),
                ("--candidate-kv-cache-dtype", args.candidate_kv_cache_dtype != "auto"),
                ("--candidate-gguf-activations", args.candidate_gguf_activations != "fp32"),
            )
            if given
        ]
        if args.record and at_load:
            raise InvalidRequestError(
                f"--record describes a candidate directory; with {at_load[0]} the report "
                "describes the directory as loaded, not its files (write it with --json instead)",
                "record",
            )
        report = compare(
            reference,
            candidate,
            args.data,
            ref_quantization=args.reference_quantization,
            cand_quantization=args.candidate_quantization,
            cand_kv_cache_dtype=args.candidate_kv_cache_dtype,
            cand_gguf_activations=args.candidate_gguf_activations,
            cand_method=args.candidate_method,
            cand_calib=args.candidate_calib,
            window=args.window,
            max_tokens=args.max_tokens,
            num_prompts=args.num_prompts,
            greedy_tokens=args.greedy_tokens,
            thresholds=Thresholds(args.max_kl_mean, args.min_top1, args.max_ppl_ratio),
        )
    except KVServeError as exc:
        print(f"kvserve eval: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.record:
        (candidate / EVALUATION_NAME).write_text(text + "\n")
    print(
        f"ppl {report['ppl_reference']:.3f} -> {report['ppl_candidate']:.3f}; KL mean "
        f"{report['kl_mean']:.5f} p99 {report['kl_p99']:.5f}; top-1 {report['top1_agreement']:.3f}; "
        f"greedy identical {report['greedy']['identical_share']:.2f}; passed {report['passed']}; "
        f"candidate {report['candidate']['sha256'][:16]}"
    )
    return 0 if report["passed"] in (None, True) else 1
