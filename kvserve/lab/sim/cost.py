"""Cost models: how long one engine step takes, from what the step computes.

A step is described by `StepLoad`: for each scheduled request, the new tokens it computes and the
context already cached before them (the scheduler's chunk: `start_position`, `len(token_ids)`).
Two models turn it into seconds:

- `RooflineStepCost`: docs/planning.md's roofline through kvserve.lab.plan.arith. Bytes = the weights
  once + every scheduled request's cache read and new KV written; FLOPs = the planner's decode
  FLOPs for one-token chunks (each new token attending to its cached context) and its prefill FLOPs
  for prompt chunks (new tokens attending causally to each other and to the cached prefix). Decode
  runs at peak, prompt chunks at MFU x peak, as the planner assumes; the step takes the max of
  memory time and compute time. A pure decode step is exactly the planner's decode-step time and a
  lone prompt chunk exactly its prefill time.
- `StepProfile`: a per-step linear model fitted to timed steps of the real engine
  (`kvserve simulate --calibrate`), saved as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvserve.core.outputs import SchedulerOutput
from kvserve.lab.plan import arith

PROFILE_KIND = "kvserve-step-profile"


@dataclass(frozen=True)
class ChunkLoad:
    """One request's share of a step: `num_new_tokens` after `num_cached_tokens` of context."""

    num_new_tokens: int
    num_cached_tokens: int

    @property
    def num_attended(self) -> int:
        """(new token, attended token) pairs: token j of the chunk attends to cached + j tokens."""
        n = self.num_new_tokens
        return n * self.num_cached_tokens + n * (n + 1) // 2


@dataclass(frozen=True)
class StepLoad:
    """What one step computes, in the terms a cost model needs."""

    chunks: tuple[ChunkLoad, ...]

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput) -> StepLoad:
        return cls(
            tuple(ChunkLoad(c.num_tokens, c.start_position) for c in scheduler_output.chunks)
        )

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def decode_chunks(self) -> tuple[ChunkLoad, ...]:
        return tuple(c for c in self.chunks if c.num_new_tokens == 1)

    @property
    def prompt_chunks(self) -> tuple[ChunkLoad, ...]:
        return tuple(c for c in self.chunks if c.num_new_tokens > 1)


STEP_KINDS = ("prefill", "decode")


def step_kind(load: StepLoad) -> str:
    """`prefill` when any chunk is a prompt chunk (prompt-only and mixed steps: their cost is
    mostly the prompt's arithmetic), else `decode` (one-token chunks: streaming the weights and the
    cache). On a shared machine the two kinds' speeds move apart (docs/simulator.md)."""
    return "prefill" if load.prompt_chunks else "decode"


# Per-step features a calibrated profile may weigh; each is a count per step.
FEATURES = {
    "const": lambda s: 1.0,
    "num_tokens": lambda s: float(s.num_tokens),
    "num_seqs": lambda s: float(s.num_seqs),
    # decode attention: tokens each one-token chunk reads (cached + itself)
    "decode_context_tokens": lambda s: float(sum(c.num_cached_tokens + 1 for c in s.decode_chunks)),
    # the same when the backend pads every decode row to the longest context in the step
    "decode_padded_context_tokens": lambda s: float(
        len(s.decode_chunks) * max((c.num_cached_tokens + 1 for c in s.decode_chunks), default=0)
    ),
    # prompt-chunk attention: causal (token, attended token) pairs
    "prompt_attention_pairs": lambda s: float(sum(c.num_attended for c in s.prompt_chunks)),
    "prompt_tokens": lambda s: float(sum(c.num_new_tokens for c in s.prompt_chunks)),
    # requests entering the engine this step (first chunk, nothing cached): intake on the server
    "num_new_requests": lambda s: float(sum(c.num_cached_tokens == 0 for c in s.chunks)),
}
DEFAULT_FEATURES = (
    "const",
    "num_tokens",
    "num_seqs",
    "decode_context_tokens",
    "prompt_attention_pairs",
)


def feature_vector(load: StepLoad, names: tuple[str, ...]) -> list[float]:
    return [FEATURES[name](load) for name in names]


class CostModel(Protocol):
    """Seconds one engine step takes to execute a scheduler decision."""

    def step_s(self, scheduler_output: SchedulerOutput) -> float: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RooflineStepCost:
    """The planner's roofline (`kvserve.lab.plan.arith.RooflineCost`) applied to any mix of decode
    tokens and prompt chunks, plus a fixed per-step overhead (scheduling, launches; 0 by default)."""

    roofline: arith.RooflineCost
    step_overhead_s: float = 0.0

    def step_bytes(self, load: StepLoad) -> float:
        """W + k x sum over requests of (cached + new) tokens: every weight once, each request's
        cache read and its new KV written (docs/planning.md's W + B k t when every chunk is one token)."""
        r = self.roofline
        if not load.chunks:
            return 0.0
        total = sum(c.num_cached_tokens + c.num_new_tokens for c in load.chunks)
        return arith.decode_step_bytes(r.weight_bytes, r.kv_bytes_per_token, 1, total)

    def step_flops(self, load: StepLoad) -> tuple[float, float]:
        """(decode FLOPs, prompt FLOPs). Decode: the planner's 2 N_matmul B + 4 L d B t with t the
        mean attended context (cached + the new token; linear in t, so the mean is exact). Prompt
        chunks: the planner's prefill FLOPs of T new tokens after S cached ones,
        2 N_matmul T + 2 L d T^2 + 4 L d S T, per chunk."""
        model = self.roofline.model
        decode = load.decode_chunks
        decode_flops = 0.0
        if decode:
            mean_context = sum(c.num_cached_tokens + 1 for c in decode) / len(decode)
            decode_flops = arith.decode_step_flops(model, len(decode), mean_context)
        prompt_flops = sum(
            arith.prefill_flops(model, c.num_new_tokens, c.num_cached_tokens)
            for c in load.prompt_chunks
        )
        return decode_flops, prompt_flops

    def step_s(self, scheduler_output: SchedulerOutput) -> float:
        return self.load_s(StepLoad.of(scheduler_output))

    def load_s(self, load: StepLoad) -> float:
        if not load.chunks:
            return 0.0
        r = self.roofline
        decode_flops, prompt_flops = self.step_flops(load)
        # Prompt chunks run at MFU x peak (the planner's TTFT assumption), decode tokens at peak.
        peak_equivalent_flops = decode_flops + prompt_flops / r.mfu
        # Tensor parallel (kvserve.lab.sim.parallel): the step's all-reduces, not overlapped; 0 on one
        # device. Every scheduled sequence counts as sampled (an upper bound on the logits gather).
        fixed_s = self.step_overhead_s + r.comm_s(load.num_tokens, load.num_seqs)
        return fixed_s + arith.roofline_time_s(
            peak_equivalent_flops,
            self.step_bytes(load),
            r.bandwidth_bytes_per_s,
            r.peak_flops_per_s,
        )

    def describe(self) -> dict[str, Any]:
        r = self.roofline
        return {
            "kind": "roofline",
            "model": r.model.name,
            "weight_bytes": r.weight_bytes,
            "kv_bytes_per_token": r.kv_bytes_per_token,
            "bandwidth_bytes_per_s": r.bandwidth_bytes_per_s,
            "peak_flops_per_s": r.peak_flops_per_s,
            "mfu": r.mfu,
            "step_overhead_s": self.step_overhead_s,
        }


@dataclass(frozen=True)
class StepProfile:
    """A calibrated step cost: sum of `coef_s[i] x feature[i]` over the named step features,
    measured on one engine, model, dtype and device (`meta` says which, and how well it fit)."""

    features: tuple[str, ...]
    coef_s: tuple[float, ...]
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown or len(self.features) != len(self.coef_s):
            raise ValueError(f"bad step profile: unknown features {unknown} or length mismatch")
        by_kind = self.meta.get("scaled_by_kind")
        if by_kind is not None:
            factors = by_kind.get("factors") if isinstance(by_kind, dict) else None
            if not (
                isinstance(factors, dict)
                and set(factors) == set(STEP_KINDS)
                and all(isinstance(f, int | float) and f > 0 for f in factors.values())
            ):
                raise ValueError(f"bad step profile: scaled_by_kind factors {factors!r}")

    def step_s(self, scheduler_output: SchedulerOutput) -> float:
        return self.load_s(StepLoad.of(scheduler_output))

    @property
    def request_overhead_s(self) -> float:
        """Per-request time outside the engine loop (HTTP intake and delivery, the client):
        a request reaches the simulated engine this long after it was sent."""
        return float(self.meta.get("request_overhead_s", 0.0))

    @property
    def pickup_s(self) -> float:
        """How long the idle engine takes to pick up an arrival (the server's queue time of a
        request that found it idle): arrivals within it join the same first step."""
        return float(self.meta.get("pickup_s", 0.0))

    def load_s(self, load: StepLoad) -> float:
        if not load.chunks:
            return 0.0
        step_s = float(np.dot(self.coef_s, feature_vector(load, self.features)))
        by_kind = self.meta.get("scaled_by_kind")
        return step_s * by_kind["factors"][step_kind(load)] if by_kind else step_s

    def scaled(self, factor: float, why: str) -> StepProfile:
        """Every step `factor` x as long (the machine ran slower or faster than at calibration:
        kvserve.lab.sim.server_steps.machine_speed); the residuals and the request overhead kept."""
        if not factor > 0:
            raise ValueError(f"a step-cost scale must be > 0, got {factor}")
        meta = self.meta | {"scaled": {"factor": factor, "why": why}}
        return StepProfile(self.features, tuple(c * factor for c in self.coef_s), meta)

    def scaled_by_kind(self, factors: dict[str, float], why: str) -> StepProfile:
        """Each kind of step (`step_kind`: prefill, decode) `factors[kind]` x as long: the machine's
        speed per kind during a run, where the memory-bound decode steps and the compute-bound
        prompt steps slowed apart (on the 2-core EPYC 1.19-1.30x against 1.00-1.05x in one run).
        Applies on top of an earlier `scaled_by_kind`; the residuals and overheads kept."""
        if set(factors) != set(STEP_KINDS) or not all(f > 0 for f in factors.values()):
            raise ValueError(f"per-kind scales must be > 0 for {STEP_KINDS}, got {factors}")
        before = self.meta.get("scaled_by_kind", {})
        old = before.get("factors", dict.fromkeys(STEP_KINDS, 1.0))
        total = {k: old[k] * float(factors[k]) for k in STEP_KINDS}
        whys = f"{before['why']}; then {why}" if before.get("why") else why
        meta = self.meta | {"scaled_by_kind": {"factors": total, "why": whys}}
        return StepProfile(self.features, self.coef_s, meta)

    def describe(self) -> dict[str, Any]:
        return {"kind": "profile", "coef_s": dict(zip(self.features, self.coef_s, strict=True))} | {
            k: v for k, v in self.meta.items() if k != "samples"
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PROFILE_KIND,
            "features": list(self.features),
            "coef_s": list(self.coef_s),
        } | self.meta

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        if data.get("kind") != PROFILE_KIND:
            raise ValueError(f"not a step profile (kind {data.get('kind')!r})")
        meta = {k: v for k, v in data.items() if k not in ("kind", "features", "coef_s")}
        return cls(tuple(data["features"]), tuple(float(c) for c in data["coef_s"]), meta)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, ValueError) as exc:
            raise ValueError(f"cannot read step profile {path}: {exc}") from exc
