"""Policies, one simulated run's metrics, rate sweeps and the capacity search.

Metrics come from `kvserve.lab.bench.summary.summarize` over the run's records (one event per token),
so TTFT, ITL, worst gaps, E2E, throughput (total output tokens / measured window, docs/metrics.md),
goodput for named objectives and the realised rate mean exactly what `kvserve bench serve` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.config import ADMISSION_POLICIES, CacheConfig, SchedulerConfig
from kvserve.kv.groups import KVLayout
from kvserve.lab.bench.capacity import Trial, find_capacity
from kvserve.lab.bench.slo import ObjectiveSet, passes
from kvserve.lab.bench.summary import summarize
from kvserve.lab.sim.cost import CostModel
from kvserve.lab.sim.loop import StepHook, simulate_continuous
from kvserve.lab.sim.speculative import Acceptance, SpecModel, SpeculativeCost
from kvserve.lab.sim.static import simulate_static
from kvserve.lab.sim.timeline import SimRun
from kvserve.lab.sim.workload import SimError, SimRequest

CHUNKED_SUFFIX = "-chunked"


@dataclass(frozen=True)
class Policy:
    """`static`, or continuous batching with `reserve` / `on_demand` admission, optionally with
    chunked prefill (`on_demand-chunked`). Names are docs/scheduling.md's."""

    name: str
    admission: str | None  # None: static
    chunked: bool = False

    @property
    def is_static(self) -> bool:
        return self.admission is None

    @classmethod
    def parse(cls, name: str) -> Policy:
        key = name.strip().lower().replace("on-demand", "on_demand")
        if key == "static":
            return cls("static", None)
        chunked = key.endswith(CHUNKED_SUFFIX)
        admission = key.removesuffix(CHUNKED_SUFFIX)
        if admission not in ADMISSION_POLICIES:
            names = ["static"] + [a + s for a in ADMISSION_POLICIES for s in ("", CHUNKED_SUFFIX)]
            raise SimError(f"unknown policy {name!r}: use one of {', '.join(names)}")
        return cls(key, admission, chunked)


@dataclass(frozen=True)
class EngineShape:
    """The engine limits every policy runs under (docs/scheduling.md: max running sequences, max
    batched tokens per step, cache occupancy).

    Chunked prefill uses `chunk_tokens` as the per-step token budget. Without it the budget is
    max_model_len + max_num_seqs: any one prompt fits a step whole beside every running request's
    decode token (the scheduler still shares one budget among several new prompts).
    """

    num_blocks: int
    max_model_len: int
    block_size: int = CacheConfig.block_size
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    chunk_tokens: int = 512
    enable_prefix_caching: bool = True
    static_batch_size: int | None = None  # None: max_num_seqs
    static_timeout_s: float = 1.0
    speculative: SpecModel | None = None  # continuous policies only
    seed: int = 0  # acceptance draws
    layout: KVLayout | None = None  # a hybrid model's KV groups (kv/groups.py); None: one table

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.max_num_seqs, self.chunk_tokens) < 1:
            raise SimError("num_blocks, block_size, max_num_seqs and chunk_tokens must be >= 1")

    def scheduler_config(self, policy: Policy) -> SchedulerConfig:
        budget = self.chunk_tokens if policy.chunked else self.max_model_len + self.max_num_seqs
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            admission=policy.admission or "on_demand",
            num_lookahead_tokens=self.speculative.num_speculative_tokens if self.speculative else 0,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_cache_tokens": self.num_blocks * self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "chunked_prefill_budget_tokens": self.chunk_tokens,
            "unchunked_budget_tokens": self.max_model_len + self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "static_batch_size": self.static_batch_size or self.max_num_seqs,
            "static_timeout_s": self.static_timeout_s,
            "speculative": self.speculative.describe() if self.speculative else None,
            "kv_groups": [g.name for g in self.layout.groups] if self.layout else ["full"],
        }


def run_policy(
    policy: Policy,
    shape: EngineShape,
    cost_model: CostModel,
    requests: tuple[SimRequest, ...],
    on_step: StepHook | None = None,
) -> SimRun:
    reset = getattr(cost_model, "reset", None)
    if reset is not None:  # a noisy cost model replays the same draws in every run
        reset()
    if policy.is_static:
        return simulate_static(
            requests,
            cost_model,
            shape.static_batch_size or shape.max_num_seqs,
            shape.static_timeout_s,
            shape.num_blocks,
            shape.block_size,
            shape.max_model_len,
            on_step,
            shape.layout,
        )
    acceptance = None
    if shape.speculative is not None:
        acceptance = Acceptance(shape.speculative, shape.seed)
        cost_model = SpeculativeCost(cost_model, shape.speculative)
    return simulate_continuous(
        requests,
        cost_model,
        shape.scheduler_config(policy),
        shape.num_blocks,
        shape.block_size,
        shape.enable_prefix_caching,
        policy.name,
        on_step,
        acceptance,
        shape.layout,
    )


def usd_per_million_output(usd_per_hour: float | None, output_tokens_per_s: float | None) -> dict:
    """docs/planning.md's cost per million output tokens at the *simulated* throughput of the run
    (its own utilisation: idle time between arrivals is paid for too)."""
    if usd_per_hour is None or not output_tokens_per_s:
        return {"usd_per_hour": usd_per_hour, "usd_per_million_output": None}
    return {
        "usd_per_hour": usd_per_hour,
        "usd_per_million_output": usd_per_hour / (output_tokens_per_s * 3600) * 1e6,
    }


# Sections of the bench summary that describe a client or a tokenizer, not the served workload.
_CLIENT_ONLY = ("client", "token_count_checks", "tokens_per_chunk")


def evaluate(
    policy: Policy,
    shape: EngineShape,
    cost_model: CostModel,
    requests: tuple[SimRequest, ...],
    rate: float | None,
    objective_sets: tuple[ObjectiveSet, ...] = (),
    usd_per_hour: float | None = None,
) -> tuple[dict, SimRun]:
    """One policy at one rate: the bench summary of the simulated records plus simulator stats."""
    run = run_policy(policy, shape, cost_model, requests)
    return run_result(policy, run, rate, objective_sets, usd_per_hour), run


def run_result(
    policy: Policy,
    run,
    rate: float | None,
    objective_sets: tuple[ObjectiveSet, ...],
    usd_per_hour: float | None,
) -> dict:
    """A simulated run (anything with `records()` and `stats()`) as the bench summary of its records,
    the simulator's statistics and the cost per million output tokens."""
    summary = summarize(run.records(), objective_sets=objective_sets, nominal_rate=rate)
    for key in _CLIENT_ONLY:
        summary.pop(key, None)
    throughput = summary.get("throughput", {}).get("output_tokens_per_s")
    return {
        "policy": policy.name,
        "nominal_rate_rps": rate,
        "summary": summary,
        "sim": run.stats(),
        "cost": usd_per_million_output(usd_per_hour, throughput),
    }


RequestSource = Callable[[float], tuple[SimRequest, ...]]


def sweep(
    policies: tuple[Policy, ...],
    rates: tuple[float, ...],
    source: RequestSource,
    shape: EngineShape,
    cost_model: CostModel,
    objective_sets: tuple[ObjectiveSet, ...] = (),
    usd_per_hour: float | None = None,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    out = []
    for rate in rates:
        requests = source(rate)
        for policy in policies:
            result, _ = evaluate(
                policy, shape, cost_model, requests, rate, objective_sets, usd_per_hour
            )
            out.append(result)
            if progress is not None:
                progress(result)
    return out


def trial_passes(result: dict, min_attainment: float) -> bool:
    goodput = result["summary"].get("goodput") or []
    return bool(goodput) and all(passes(g, min_attainment) for g in goodput)


def search_capacity(
    policy: Policy,
    source: RequestSource,
    shape: EngineShape,
    cost_model: CostModel,
    objective_sets: tuple[ObjectiveSet, ...],
    min_attainment: float = 0.9,
    start_rps: float = 1.0,
    max_rps: float = 1024.0,
    rel_tol: float = 0.05,
    max_trials: int = 16,
    usd_per_hour: float | None = None,
) -> dict:
    """The highest arrival rate at which every objective set passes (the bench's conservative
    bracket-and-bisect search), and the simulated cost per million output tokens there."""

    def run(rate: float) -> dict:
        return evaluate(
            policy, shape, cost_model, source(rate), rate, objective_sets, usd_per_hour
        )[0]

    return capacity_search(
        policy.name, run, objective_sets, min_attainment, start_rps, max_rps, rel_tol, max_trials
    )


def capacity_search(
    policy_name: str,
    run: Callable[[float], dict],
    objective_sets: tuple[ObjectiveSet, ...],
    min_attainment: float,
    start_rps: float,
    max_rps: float,
    rel_tol: float,
    max_trials: int,
) -> dict:
    """`find_capacity` over `run(rate)` (a simulated run's result): a rate passes when every
    objective set's attainment is at least `min_attainment`."""
    if not objective_sets:
        raise SimError("--find-capacity needs at least one --slo objective set")
    results: dict[float, dict] = {}

    def trial(rate: float) -> Trial:
        result = results[rate] = run(rate)
        return Trial(rate, trial_passes(result, min_attainment), brief(result))

    found = find_capacity(trial, start_rps, max_rps, rel_tol, max_trials)
    out = {"policy": policy_name} | found.to_json()
    at_capacity = results.get(found.capacity_rps) if found.capacity_rps else None
    out["at_capacity"] = brief(at_capacity) if at_capacity else None
    return out


def brief(result: dict) -> dict:
    """The few numbers of a run a table or a capacity trial shows."""
    s = result["summary"]
    lat = s.get("latency_s", {})
    thr = s.get("throughput", {})

    def pct(metric: str, key: str) -> float | None:
        return lat.get(metric, {}).get(key)

    return {
        "policy": result["policy"],
        "nominal_rate_rps": result["nominal_rate_rps"],
        "realised_rate_rps": s.get("arrivals", {}).get("realised_rate_rps"),
        "ttft_p50_s": pct("ttft", "p50"),
        "ttft_p99_s": pct("ttft", "p99"),
        "itl_p50_s": pct("itl", "p50"),
        "itl_p99_s": pct("itl", "p99"),
        "itl_max_s": pct("itl", "max"),
        "worst_gap_p50_s": pct("worst_gap", "p50"),
        "worst_gap_p99_s": pct("worst_gap", "p99"),
        "e2e_p50_s": pct("e2e", "p50"),
        "e2e_p99_s": pct("e2e", "p99"),
        "output_tokens_per_s": thr.get("output_tokens_per_s"),
        "requests_per_s": thr.get("requests_per_s"),
        "num_completed": thr.get("num_completed"),
        "num_failed": s.get("counts", {}).get("failed"),
        "goodput_rps": [g.get("goodput_rps") for g in s.get("goodput", [])],
        "num_preemptions": result["sim"]["num_preemptions"],
        "usd_per_million_output": result["cost"]["usd_per_million_output"],
    }
