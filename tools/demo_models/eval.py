"""Held-out perplexity of exported models on code and on prose, and a unigram baseline on the same split.

Perplexity is exp(total NLL / number of scored tokens) over fixed-length, non-overlapping windows of
the held-out token stream (documents joined as <|bos|> text <|end|>); every token but each window's
first is scored exactly once, and never the mean of per-window perplexities. `fixed_windows` is the
one windowing function (in `kvserve.evaluation`, shared with `kvserve eval perplexity`), so both report
one number.

    python -m tools.demo_models.eval kvserve/assets/demo/target kvserve/assets/demo/draft \
        [--window 512] [--max-tokens N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvserve.evaluation import fixed_windows, unigram_nll
from tools.demo_models.common import KINDS

TOKENS_DIR = Path(__file__).resolve().parent / "work" / "tokens"


def num_scored_tokens(windows: Sequence[Sequence[int]]) -> int:
    return sum(len(w) - 1 for w in windows)


def equal_length_batches(
    windows: Sequence[Sequence[int]], batch_size: int
) -> list[Sequence[Sequence[int]]]:
    """Consecutive groups of at most `batch_size` windows of one length (only the tail differs)."""
    batches: list[list[Sequence[int]]] = []
    for window in windows:
        if batches and len(batches[-1]) < batch_size and len(batches[-1][0]) == len(window):
            batches[-1].append(window)
        else:
            batches.append([window])
    return batches


def model_nll(
    model, windows: Sequence[Sequence[int]], batch_size: int = 8, device: str = "cpu"
) -> tuple[float, int]:
    """Total next-token NLL (nats) of `model` on the scored positions of `windows`, and their count."""
    import torch
    import torch.nn.functional as F

    total_nll, total_count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for batch in equal_length_batches(windows, batch_size):
            ids = torch.as_tensor(np.asarray(batch, dtype=np.int64), device=device)  # [B, T]
            logits = model(input_ids=ids).logits.float()  # [B, T, V]
            nll = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
            )
            total_nll += nll.item()
            total_count += ids[:, 1:].numel()
    return total_nll, total_count


def load_tokens(tokens_dir: Path, split: str, kind: str) -> np.ndarray:
    return np.fromfile(tokens_dir / f"{split}_{kind}.bin", dtype=np.uint16)


def evaluate(
    model_dirs: dict[str, Path],
    tokens_dir: Path,
    window_len: int,
    max_tokens: int | None,
    device: str = "cpu",
) -> dict:
    """{window_len, models, kinds: {kind: {num_scored_tokens, unigram: {nll, ppl}, <model>: {...}}}}."""
    import torch
    from transformers import AutoModelForCausalLM

    results: dict = {"window_len": window_len, "models": list(model_dirs), "kinds": {}}
    models = {
        name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device)
        for name, d in model_dirs.items()
    }
    vocab_size = next(iter(models.values())).config.vocab_size if models else 8192
    for kind in KINDS:
        heldout = load_tokens(tokens_dir, "heldout", kind)
        if max_tokens:
            heldout = heldout[:max_tokens]
        windows = fixed_windows(heldout.tolist(), window_len)
        nll, count = unigram_nll(load_tokens(tokens_dir, "train", kind), windows, vocab_size)
        entry = {
            "num_scored_tokens": count,
            "unigram": {"nll": nll / count, "ppl": math.exp(nll / count)},
        }
        for name, model in models.items():
            start = time.perf_counter()
            nll, count = model_nll(model, windows, device=device)
            entry[name] = {
                "nll": nll / count,
                "ppl": math.exp(nll / count),
                "seconds": round(time.perf_counter() - start, 1),
            }
        results["kinds"][kind] = entry
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="*", help="exported HF model directories")
    parser.add_argument("--tokens", type=Path, default=TOKENS_DIR)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=None, help="cap held-out tokens per kind")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    names = [d.name for d in args.models]
    if len(set(names)) != len(names):
        names = [str(d) for d in args.models]
    results = evaluate(
        dict(zip(names, args.models, strict=True)),
        args.tokens,
        args.window,
        args.max_tokens,
        args.device,
    )
    for kind, entry in results["kinds"].items():
        print(f"{kind}: {entry['num_scored_tokens']:,d} scored tokens, window {args.window}")
        for name, value in entry.items():
            if isinstance(value, dict):
                print(f"  {name:20s} ppl {value['ppl']:10.2f}  (nll {value['nll']:.4f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
