"""Held-out perplexity of exported models on code and on prose, and a unigram baseline on the same split.

Perplexity is exp(total NLL / number of scored tokens) over fixed-length, non-overlapping windows of
the held-out token stream (documents joined as <|bos|> text <|end|>); every token but each window's
first is scored exactly once, and never the mean of per-window perplexities. `fixed_windows` is the
one windowing function; `kvserve eval perplexity` is meant to reuse it so both report one number.

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

from tools.demo_models.common import KINDS

TOKENS_DIR = Path(__file__).resolve().parent / "work" / "tokens"


def fixed_windows(token_ids: Sequence[int], window_len: int) -> list[Sequence[int]]:
    """Cut `token_ids` into consecutive non-overlapping windows of `window_len` tokens.

    The last window may be shorter; it is dropped if it has fewer than 2 tokens (nothing to score).
    Each window is scored on its positions 1..len-1 given the tokens before them in the same window,
    so every token except the windows' first tokens is scored exactly once.
    """
    if window_len < 2:
        raise ValueError(f"window_len must be at least 2, got {window_len}")
    windows = [token_ids[i : i + window_len] for i in range(0, len(token_ids), window_len)]
    return [w for w in windows if len(w) >= 2]


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


def unigram_nll(
    train_ids: np.ndarray, windows: Sequence[Sequence[int]], vocab_size: int
) -> tuple[float, int]:
    """NLL of an add-one-smoothed unigram model fitted on `train_ids`, on the same positions."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    targets = np.concatenate([np.asarray(w[1:], dtype=np.int64) for w in windows])
    return float(-log_probs[targets].sum()), int(targets.size)


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
