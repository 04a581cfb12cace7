"""`kvserve eval perplexity` against a direct transformers computation, and its windowing rules."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from kvserve.cli import main
from kvserve.evaluation import fixed_windows, perplexity, token_stream, unigram_nll

DOCS = [
    "The river ran past the old mill, and the miller counted his sacks of grain.",
    "def area(radius):\n    return 3.14159 * radius ** 2\n",
    "In the beginning the machine was quiet; then the fans spun up and the lights came on.",
]


def test_windows_cover_every_token_once():
    ids = list(range(23))
    windows = fixed_windows(ids, 5)
    assert [len(w) for w in windows] == [5, 5, 5, 5, 3]
    assert sum(len(w) - 1 for w in windows) == 23 - 5  # each window's first token is context only
    assert fixed_windows(list(range(11)), 5)[-1] == [5, 6, 7, 8, 9]  # a 1-token tail is dropped


def test_perplexity_is_exp_of_mean_loss_not_mean_of_window_perplexities():
    # Two windows: 3 tokens at NLL 1 each, 1 token at NLL 5.
    assert math.isclose(perplexity(3 * 1.0 + 5.0, 4), math.exp(2.0))
    assert not math.isclose(perplexity(8.0, 4), (math.exp(1.0) + math.exp(5.0)) / 2)


def test_cli_matches_transformers(gpt2_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / "ppl.json"
    args = ["eval", "perplexity", str(gpt2_model_dir), "--data", str(data), "--window", "16",
            "--unigram-train", str(data), "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())

    tokenizer = AutoTokenizer.from_pretrained(gpt2_model_dir)
    model = AutoModelForCausalLM.from_pretrained(gpt2_model_dir, dtype=torch.float32).eval()
    ids = token_stream(tokenizer, DOCS)
    total, count = 0.0, 0
    with torch.no_grad():
        for window in fixed_windows(ids, 16):
            logits = model(torch.tensor([window])).logits[0]
            total += F.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="sum").item()
            count += len(window) - 1
    assert result["num_scored_tokens"] == count
    assert math.isclose(result["ppl"], math.exp(total / count), rel_tol=1e-4)
    nll, n = unigram_nll(ids, fixed_windows(ids, 16), tokenizer.vocab_size)
    assert math.isclose(result["unigram"]["ppl"], math.exp(nll / n), rel_tol=1e-9)
