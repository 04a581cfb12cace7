"""Held-out perplexity: token streams from documents, fixed windows, and a unigram baseline. Torch-free.

Perplexity = exp(total negative log-likelihood / number of scored tokens) over fixed-length,
non-overlapping windows; every token but each window's first is scored exactly once. It is never the mean
of per-window perplexities (that over-weights short, surprising windows).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvserve.core.errors import InvalidRequestError


def read_documents(path: str | Path) -> list[str]:
    """A `.jsonl` file (one object per line with a "text" field) or a plain-text file (one document)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(
            f"data file {str(path)!r} does not exist (give a .jsonl file with one "
            '{"text": "..."} object per line, or a plain-text file)',
            "data",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"data file {str(path)!r} is not UTF-8 text: {exc}", "data"
        ) from None
    if path.suffix != ".jsonl":
        return [text]
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            documents.append(str(json.loads(line)["text"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f'{path}:{number}: expected a JSON object with a "text" field ({exc!r})', "data"
            ) from exc
    return documents


def token_stream(tokenizer, documents: Sequence[str]) -> list[int]:
    """Documents joined as BOS text EOS (each when the tokenizer defines it)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids: list[int] = []
    for document in documents:
        if bos is not None:
            ids.append(bos)
        ids.extend(tokenizer.encode(document, add_special_tokens=False))
        if eos is not None:
            ids.append(eos)
    return ids


def fixed_windows(token_ids: Sequence[int], window_len: int) -> list[Sequence[int]]:
    """Consecutive non-overlapping windows of `window_len` tokens; a last window shorter than 2 tokens
    (nothing to score) is dropped. Window w scores its positions 1..len-1 given the tokens before them."""
    if window_len < 2:
        raise ValueError(f"window_len must be at least 2, got {window_len}")
    windows = [token_ids[i : i + window_len] for i in range(0, len(token_ids), window_len)]
    return [w for w in windows if len(w) >= 2]


def unigram_nll(
    train_ids: Sequence[int], windows: Sequence[Sequence[int]], vocab_size: int
) -> tuple[float, int]:
    """Total NLL (nats) of an add-one-smoothed unigram model fitted on `train_ids`, on the scored positions."""
    counts = np.bincount(np.asarray(train_ids, dtype=np.int64), minlength=vocab_size)
    log_probs = np.log((counts[:vocab_size] + 1.0) / (counts[:vocab_size].sum() + vocab_size))
    targets = np.concatenate([np.asarray(w[1:], dtype=np.int64) for w in windows])
    return float(-log_probs[targets].sum()), int(targets.size)


def perplexity(total_nll: float, num_tokens: int) -> float:
    return math.exp(total_nll / num_tokens)
