"""Compare a candidate model with its reference on the same token windows (docs/quantization.md,
"evaluating an artifact"), as llama.cpp's `llama-perplexity --kl-divergence` does.

Per scored position: KL(p_R || p_Q) = sum_i p_R(i) (log p_R(i) - log p_Q(i)), reported as mean and p99;
top-1 agreement = share of positions where argmax p_Q = argmax p_R; perplexity of each. Greedy
agreement: the first position at which the greedy continuations of the same prompt differ. The report
names both models' identities (artifact hash and load-time quantisation): it belongs to those files.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.core.errors import InvalidRequestError

EVALUATION_NAME = "kvserve_evaluation.json"


@dataclass(frozen=True)
class Thresholds:
    """A candidate passes when every given bound holds."""

    max_kl_mean: float | None = None
    min_top1: float | None = None
    max_ppl_ratio: float | None = None


def model_identity(
    model_dir: str | Path, quantization: str | None, method: str = "rtn", calib: str | None = None
) -> dict:
    """What determines the model's weights: the files, the scheme applied at load and, for a
    calibrated method at load, the method and the calibration text's hash."""
    from kvserve.paths import sha256_file
    from kvserve.quant.convert import artifact_sha256

    identity = {"artifact_sha256": artifact_sha256(model_dir), "quantization": quantization}
    if method != "rtn":
        identity |= {"method": method, "calibration_sha256": sha256_file(Path(calib))}
    identity["sha256"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return identity


def window_stats(ref_logits: torch.Tensor, cand_logits: torch.Tensor, window: list[int]) -> dict:
    """ref/cand logits [T, V] for `window` -> per scored position NLLs, KL and top-1 matches."""
    targets = torch.tensor(window[1:])
    ref_lp = F.log_softmax(ref_logits[:-1].double(), dim=-1)  # [T-1, V]
    cand_lp = F.log_softmax(cand_logits[:-1].double(), dim=-1)
    kl = (ref_lp.exp() * (ref_lp - cand_lp)).sum(dim=-1).clamp(min=0.0)  # [T-1]
    return {
        "ref_nll": -ref_lp.gather(1, targets[:, None]).squeeze(1),
        "cand_nll": -cand_lp.gather(1, targets[:, None]).squeeze(1),
        "kl": kl,
        "top1": ref_lp.argmax(-1) == cand_lp.argmax(-1),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(
    ref_dir: str | Path,
    cand_dir: str | Path,
    data: str | Path,
    *,
    ref_quantization: str | None = None,
    cand_quantization: str | None = None,
    cand_method: str = "rtn",
    cand_calib: str | None = None,
    window: int = 256,
    max_tokens: int | None = None,
    num_prompts: int = 8,
    prompt_len: int = 16,
    greedy_tokens: int = 32,
    thresholds: Thresholds = Thresholds(),
) -> dict:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM
    from kvserve.evaluation import fixed_windows, read_documents, token_stream

    options = dict(max_num_seqs=num_prompts, num_blocks=None)
    ref = LLM(str(ref_dir), quantization=ref_quantization, **options)
    cand = LLM(
        str(cand_dir),
        quantization=cand_quantization,
        quantization_method=cand_method,
        calib=cand_calib,
        **options,
    )
    if ref.tokenizer is None:
        raise InvalidRequestError(f"{ref_dir} has no tokenizer", "reference")
    ids = token_stream(ref.tokenizer, read_documents(data))[:max_tokens]
    windows = fixed_windows(ids, min(window, ref.engine.max_model_len))
    if not windows:  # fuzzing: an empty file gave an IndexError
        raise InvalidRequestError(f"{data} holds fewer than 2 tokens", "data")
    ref_vocab, cand_vocab = ref.engine.config.model.vocab_size, cand.engine.config.model.vocab_size
    if ref_vocab != cand_vocab:  # fuzzing: a tensor-size RuntimeError from the KL
        raise InvalidRequestError(
            f"the reference's vocabulary ({ref_vocab}) and the candidate's ({cand_vocab}) differ: "
            "compare models that share a tokenizer",
            "candidate",
        )
    stats = [
        window_stats(ref.engine.score(list(w)), cand.engine.score(list(w)), list(w))
        for w in windows
    ]
    cat = {k: torch.cat([s[k] for s in stats]) for k in stats[0]}
    num_scored = int(cat["kl"].numel())
    prompts = [list(w[:prompt_len]) for w in windows[:num_prompts] if len(w) >= prompt_len]
    params = SamplingParams(max_tokens=greedy_tokens, temperature=0.0, ignore_eos=True)
    ref_out = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    cand_out = [o.outputs[0].token_ids for o in cand.generate(prompts, params)]
    firsts = [first_difference(list(a), list(b)) for a, b in zip(ref_out, cand_out, strict=True)]
    report = {
        "reference": {"dir": str(ref_dir), **model_identity(ref_dir, ref_quantization)},
        "candidate": {
            "dir": str(cand_dir),
            **model_identity(cand_dir, cand_quantization, cand_method, cand_calib),
        },
        "data": str(data),
        "window": len(windows[0]) if windows else window,
        "num_windows": len(windows),
        "num_scored_tokens": num_scored,
        "ppl_reference": math.exp(cat["ref_nll"].mean().item()),
        "ppl_candidate": math.exp(cat["cand_nll"].mean().item()),
        "kl_mean": cat["kl"].mean().item(),
        "kl_p99": torch.quantile(cat["kl"].float(), 0.99).item(),
        "top1_agreement": cat["top1"].float().mean().item(),
        "greedy": {
            "num_prompts": len(prompts),
            "tokens": greedy_tokens,
            "first_difference": firsts,  # None: identical continuation
            "identical_share": sum(f is None for f in firsts) / max(1, len(firsts)),
        },
    }
    checks = {
        "kl_mean": (thresholds.max_kl_mean, report["kl_mean"] <= (thresholds.max_kl_mean or 0)),
        "top1": (thresholds.min_top1, report["top1_agreement"] >= (thresholds.min_top1 or 0)),
        "ppl_ratio": (
            thresholds.max_ppl_ratio,
            report["ppl_candidate"] / report["ppl_reference"] <= (thresholds.max_ppl_ratio or 0),
        ),
    }
    given = {k: ok for k, (bound, ok) in checks.items() if bound is not None}
    report["thresholds"] = {k: bound for k, (bound, _) in checks.items() if bound is not None}
    report["passed"] = all(given.values()) if given else None
    report["sha256"] = hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()
    return report


def recorded_evaluation(model_dir: str | Path) -> dict | None:
    """The evaluation recorded beside an artifact (`eval compare --record`), if it still matches the
    files: its hash and whether it passed."""
    from kvserve.quant.convert import artifact_sha256

    path = Path(model_dir) / EVALUATION_NAME
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    current = report.get("candidate", {}).get("artifact_sha256") == artifact_sha256(model_dir)
    return {"sha256": report.get("sha256"), "passed": report.get("passed"), "current": current}
