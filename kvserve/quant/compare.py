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
from kvserve.quant.methods import DEFAULT_METHOD
from kvserve.quant.provenance import artifact_sha256


@dataclass(frozen=True)
class Thresholds:
    """A candidate passes when every given bound holds."""

    max_kl_mean: float | None = None
    min_top1: float | None = None
    max_ppl_ratio: float | None = None


def model_identity(
    model_dir: str | Path,
    quantization: str | None,
    method: str = DEFAULT_METHOD,
    calib: str | None = None,
    kv_cache_dtype: str = "auto",
    gguf_activations: str = "fp32",
) -> dict:
    """What determines the model's outputs: the files (for a GGUF model, the GGUF file's hash too:
    its directory's config.json does not hold the weights), the scheme applied at load, for a
    calibrated method at load the method and the calibration text's hash, an 8-bit KV cache, and a
    GGUF model's int8 activations."""
    from kvserve.gguf.source import gguf_source
    from kvserve.paths import sha256_file

    identity = {"artifact_sha256": artifact_sha256(model_dir), "quantization": quantization}
    if (source := gguf_source(model_dir)) is not None:
        identity["gguf_sha256"] = sha256_file(source)
    if method != DEFAULT_METHOD:
        identity |= {"method": method, "calibration_sha256": sha256_file(Path(calib))}
    if kv_cache_dtype != "auto":  # absent when "auto": earlier reports' hashes stay the same
        identity["kv_cache_dtype"] = kv_cache_dtype
    if gguf_activations != "fp32":
        identity["gguf_activations"] = gguf_activations
    identity["sha256"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return identity


@dataclass(frozen=True)
class EvalModel:
    """One side of a comparison: the model's files and what is applied at load."""

    model_dir: Path
    quantization: str | None = None
    method: str = DEFAULT_METHOD
    calib: str | None = None
    kv_cache_dtype: str = "auto"
    gguf_activations: str = "fp32"

    def load(self, max_num_seqs: int):
        from kvserve.engine.llm import LLM

        return LLM(
            str(self.model_dir),
            quantization=self.quantization,
            quantization_method=self.method,
            calib=self.calib,
            kv_cache_dtype=self.kv_cache_dtype,
            gguf_activations=self.gguf_activations,
            max_num_seqs=max_num_seqs,
            num_blocks=None,
        )

    def identity(self) -> dict:
        return {
            "dir": str(self.model_dir),
            **model_identity(
                self.model_dir,
                self.quantization,
                self.method,
                self.calib,
                self.kv_cache_dtype,
                self.gguf_activations,
            ),
        }


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


@dataclass(frozen=True)
class ReferenceRun:
    """The reference's side of a comparison on one text, computed once and reused for every candidate
    (`benchmarks/quality_table.py` compares several)."""

    data: str
    windows: list[list[int]]
    logits: list[torch.Tensor]  # per window [T, V]
    prompts: list[list[int]]
    greedy: list[list[int]]  # the reference's greedy continuation of each prompt
    greedy_tokens: int


def reference_run(
    ref,
    data: str | Path,
    *,
    window: int = 256,
    max_tokens: int | None = None,
    num_prompts: int = 8,
    prompt_len: int = 16,
    greedy_tokens: int = 32,
) -> ReferenceRun:
    """Score `data` (read_documents) with the loaded reference `ref` (an LLM)."""
    from kvserve.evaluation import fixed_windows, read_documents, token_stream

    if ref.tokenizer is None:
        raise InvalidRequestError(f"{ref.config.model_dir} has no tokenizer", "reference")
    ids = token_stream(ref.tokenizer, read_documents(data))[:max_tokens]
    windows = [list(w) for w in fixed_windows(ids, min(window, ref.engine.max_model_len))]
    if not windows:
        raise InvalidRequestError(f"{data} holds fewer than 2 tokens", "data")
    prompts = [w[:prompt_len] for w in windows[:num_prompts] if len(w) >= prompt_len]
    return ReferenceRun(
        data=str(data),
        windows=windows,
        logits=[ref.engine.score(w) for w in windows],
        prompts=prompts,
        greedy=_greedy(ref, prompts, greedy_tokens),
        greedy_tokens=greedy_tokens,
    )


def _greedy(llm, prompts: list[list[int]], greedy_tokens: int) -> list[list[int]]:
    from kvserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=greedy_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def candidate_stats(run: ReferenceRun, cand, thresholds: Thresholds = Thresholds()) -> dict:
    """The report's measurements of the loaded candidate `cand` (an LLM) against `run`."""
    vocab_sizes = {run.logits[0].shape[-1], cand.engine.config.model.vocab_size}
    if len(vocab_sizes) != 1:  # the KL needs one vocabulary
        raise InvalidRequestError(
            f"the reference's vocabulary ({run.logits[0].shape[-1]}) and the candidate's "
            f"({cand.engine.config.model.vocab_size}) differ: compare models that share a tokenizer",
            "candidate",
        )
    stats = [
        window_stats(ref_logits, cand.engine.score(w), w)
        for ref_logits, w in zip(run.logits, run.windows, strict=True)
    ]
    cat = {k: torch.cat([s[k] for s in stats]) for k in stats[0]}
    cand_out = _greedy(cand, run.prompts, run.greedy_tokens)
    firsts = [first_difference(a, b) for a, b in zip(run.greedy, cand_out, strict=True)]
    report = {
        "data": run.data,
        "window": len(run.windows[0]),
        "num_windows": len(run.windows),
        "num_scored_tokens": int(cat["kl"].numel()),
        "ppl_reference": math.exp(cat["ref_nll"].mean().item()),
        "ppl_candidate": math.exp(cat["cand_nll"].mean().item()),
        "kl_mean": cat["kl"].mean().item(),
        "kl_p99": torch.quantile(cat["kl"].float(), 0.99).item(),
        "top1_agreement": cat["top1"].float().mean().item(),
        "greedy": {
            "num_prompts": len(run.prompts),
            "tokens": run.greedy_tokens,
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
    return report


def signed_report(reference: EvalModel, candidate: EvalModel, stats: dict) -> dict:
    """The report: both models' identities, then the measurements, and the hash of it all."""
    report = {"reference": reference.identity(), "candidate": candidate.identity(), **stats}
    report["sha256"] = hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()
    return report


def compare(
    ref_dir: str | Path,
    cand_dir: str | Path,
    data: str | Path,
    *,
    ref_quantization: str | None = None,
    cand_quantization: str | None = None,
    cand_method: str = DEFAULT_METHOD,
    cand_calib: str | None = None,
    cand_kv_cache_dtype: str = "auto",
    cand_gguf_activations: str = "fp32",
    window: int = 256,
    max_tokens: int | None = None,
    num_prompts: int = 8,
    prompt_len: int = 16,
    greedy_tokens: int = 32,
    thresholds: Thresholds = Thresholds(),
) -> dict:
    """`ref_quantization` "fp32" on a GGUF model: every block dequantised to fp32, the reference
    for its quantisations (docs/quantization.md)."""
    reference = EvalModel(Path(ref_dir), ref_quantization)
    candidate = EvalModel(
        Path(cand_dir),
        cand_quantization,
        cand_method,
        cand_calib,
        cand_kv_cache_dtype,
        cand_gguf_activations,
    )
    ref = reference.load(num_prompts)
    cand = candidate.load(num_prompts)
    run = reference_run(
        ref,
        data,
        window=window,
        max_tokens=max_tokens,
        num_prompts=num_prompts,
        prompt_len=prompt_len,
        greedy_tokens=greedy_tokens,
    )
    return signed_report(reference, candidate, candidate_stats(run, cand, thresholds))
