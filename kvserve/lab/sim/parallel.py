"""More than one device in the simulator (docs/parallel.md): tensor-parallel replicas behind a
data-parallel router.

- `tensor_parallel_deployment`: the roofline deployment of one tensor-parallel rank
  (`kvserve.lab.plan.parallel.shard_model`: 1/N of the weights and of the KV heads, replicated when
  N > n_kv) with the step's all-reduces added to every step (the planner's communication term).
  Every rank holds the same token positions, so a replica's cache holds as many tokens as one
  rank's share of the memory does.
- `simulate_data_parallel`: M replicas, each the engine's own Scheduler and KVCacheManager on its
  own clock, stepped exactly as `kvserve.lab.sim.loop.simulate_continuous` steps one; at each arrival
  every replica is advanced to that time and the router picks one (the engine-process design:
  prefix affinity by the first block's hash, else the least loaded replica).
- `SharedPrefixes`: requests in G groups whose prompts start with the group's common prefix, so
  affinity and the prefix cache have something to find (the default synthetic prompts share
  nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.config import SchedulerConfig
from kvserve.kv.groups import KVLayout
from kvserve.kv.hashing import ROOT_HASH, hash_block
from kvserve.kv.manager import KVCacheManager
from kvserve.lab.bench.slo import ObjectiveSet
from kvserve.lab.plan import Assumptions, HardwareProfile, ModelSpec
from kvserve.lab.plan.formats import parse_weight_format
from kvserve.lab.plan.parallel import Parallelism, activation_bytes, shard_model
from kvserve.lab.sim.cost import CostModel, RooflineStepCost
from kvserve.lab.sim.loop import fake_runner_output
from kvserve.lab.sim.setup import Deployment, roofline_deployment
from kvserve.lab.sim.study import (
    EngineShape,
    Policy,
    capacity_search,
    run_result,
)
from kvserve.lab.sim.timeline import (
    EOS_TOKEN_ID,
    FAKE_TOKEN_ID,
    RequestTimeline,
    SimRun,
    make_request,
    prompt_token_ids,
    validation_error,
)
from kvserve.lab.sim.workload import SimError, SimRequest
from kvserve.sched.scheduler import Scheduler

ROUTERS = ("affinity", "least-loaded", "round-robin")


def tensor_parallel_deployment(
    model: ModelSpec,
    hardware: HardwareProfile,
    parallelism: Parallelism,
    weights: str = "bf16",
    kv_dtype: str = "bf16",
    assumptions: Assumptions | None = None,
    step_overhead_s: float = 0.0,
    kv_cache_bytes: float | None = None,
) -> Deployment:
    """One replica of `parallelism.tensor_parallel` ranks: the rank's roofline plus its
    all-reduces. `kv_cache_bytes`, when given, is per device."""
    tp = parallelism.tensor_parallel
    base = roofline_deployment(
        shard_model(model, tp),
        hardware,
        weights,
        kv_dtype,
        assumptions,
        step_overhead_s,
        kv_cache_bytes,
    )
    comm = parallelism.comm(model, activation_bytes(parse_weight_format(weights)))
    cost = base.cost_model
    assert isinstance(cost, RooflineStepCost)
    if tp > 1:
        cost = replace(cost, roofline=replace(cost.roofline, comm=comm))
    description = base.description | {
        "model": model.name,
        "tensor_parallel": tp,
        "data_parallel": parallelism.data_parallel,
        "num_devices": parallelism.num_devices,
        "interconnect": parallelism.link.name,
        "interconnect_bandwidth_bytes_per_s": parallelism.link.bandwidth_bytes_per_s,
        "interconnect_latency_s": parallelism.link.latency_s,
        "interconnect_source": parallelism.link.source,
        "remote_core_message_s": parallelism.core_message_s,
        "allreduce_bytes_per_layer_per_token": comm.layer_bytes_per_token(),
        "weight_bytes_per_device": base.description["weight_bytes"],
        "kv_bytes_per_token_per_device": base.description["kv_bytes_per_token"],
    }
    return Deployment(
        cost, base.kv_cache_bytes, base.kv_bytes_per_token, description, base.defaults
    )


@dataclass(frozen=True)
class SharedPrefixes:
    """Request i belongs to group i % `num_groups`; its first `num_tokens` prompt tokens (at most
    all but its last) are the group's, the rest its own."""

    num_groups: int
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.num_tokens < 1:
            raise SimError("shared prefixes need at least one group of at least one token")

    @classmethod
    def parse(cls, text: str) -> SharedPrefixes:
        groups, _, tokens = text.partition(":")
        try:
            return cls(int(groups), int(tokens))
        except ValueError as exc:
            raise SimError(f"--shared-prefix takes GROUPS:TOKENS, got {text!r}") from exc

    def token_ids(self, sim: SimRequest) -> tuple[int, ...]:
        shared = min(self.num_tokens, sim.num_prompt_tokens - 1)
        if shared < 1:
            return prompt_token_ids(sim.index, sim.num_prompt_tokens)
        # Group ids sit above every request id so no group prefix equals a unique prompt.
        group = (EOS_TOKEN_ID + 2 + 10**9 + sim.index % self.num_groups,)
        prefix = group + (FAKE_TOKEN_ID,) * (shared - 1)
        return prefix + prompt_token_ids(sim.index, sim.num_prompt_tokens - shared)


def first_block_hash(token_ids: tuple[int, ...], block_size: int) -> bytes | None:
    """The prefix cache's hash of the first full block (kvserve.kv.hashing), None when shorter."""
    if len(token_ids) < block_size:
        return None
    return hash_block(ROOT_HASH, token_ids[:block_size])


@dataclass
class Replica:
    """One engine core: its own scheduler, KV manager and clock."""

    index: int
    scheduler: Scheduler
    kv: KVCacheManager
    cost_model: CostModel
    timelines: dict[str, RequestTimeline]
    now: float = 0.0
    busy_s: float = 0.0
    num_steps: int = 0
    peak_kv_usage: float = 0.0
    request_indices: list[int] = field(default_factory=list)
    message_s: float = 0.0  # a core on another host: each delta reaches the client this much later

    @property
    def load(self) -> int:
        """Requests in the replica (waiting + running): what least-loaded routing compares."""
        return self.scheduler.num_waiting + self.scheduler.num_running

    def step(self) -> bool:
        """One engine step, as kvserve.lab.sim.loop does it; False when nothing could be scheduled."""
        out = self.scheduler.schedule(self.now)
        if out.empty:
            return False
        for new in out.new_requests:
            self.timelines[new.request_id].first_scheduled_s = self.now
        for rid in out.preempted_request_ids:
            self.timelines[rid].num_preemptions += 1
        step_s = self.cost_model.step_s(out)
        self.now += step_s
        self.busy_s += step_s
        self.num_steps += 1
        self.peak_kv_usage = max(self.peak_kv_usage, self.kv.usage)
        for update in self.scheduler.update(out, fake_runner_output(out)):
            timeline = self.timelines[update.request_id]
            delivered_s = self.now + self.message_s
            timeline.token_times_s.extend([delivered_s] * len(update.new_token_ids))
            if update.finish_reason is not None:
                timeline.finish_s = delivered_s
        return True

    def advance_to(self, t: float) -> None:
        """Run steps that start before `t`; an idle replica waits until `t`. A step that
        straddles `t` finishes first: the engine adds requests between steps."""
        while self.now < t and self.scheduler.has_unfinished():
            if not self.step():
                break
        self.now = max(self.now, t)

    def drain(self) -> None:
        while self.scheduler.has_unfinished():
            if not self.step():
                raise SimError(
                    f"replica {self.index} is stuck at t={self.now:.3f}s with "
                    f"{self.scheduler.num_waiting} waiting and nothing running"
                )

    def stats(self) -> dict[str, Any]:
        s = self.kv.stats
        return {
            "replica": self.index,
            "num_requests": len(self.request_indices),
            "num_steps": self.num_steps,
            "busy_s": self.busy_s,
            "end_s": self.now,
            "peak_kv_usage": self.peak_kv_usage,
            "prefix_cache_hit_rate": s.num_hits / s.num_queries if s.num_queries else None,
            "request_indices": list(self.request_indices),
        }


Router = Callable[[list[Replica], bytes | None, int], int]


def make_router(name: str) -> Router:
    """`affinity`: the replica that first received a request with this first-block hash, else the
    least loaded (ties: lowest index); `least-loaded`; `round-robin` (the arrival's order)."""
    if name not in ROUTERS:
        raise SimError(f"unknown router {name!r}: use one of {', '.join(ROUTERS)}")
    owners: dict[bytes, int] = {}

    def least_loaded(replicas: list[Replica]) -> int:
        return min(replicas, key=lambda r: (r.load, r.index)).index

    def route(replicas: list[Replica], block_hash: bytes | None, arrival_index: int) -> int:
        if name == "round-robin":
            return arrival_index % len(replicas)
        if name == "least-loaded" or block_hash is None:
            return least_loaded(replicas)
        if block_hash not in owners:
            owners[block_hash] = least_loaded(replicas)
        return owners[block_hash]

    return route


@dataclass
class DataParallelRun:
    """A run over M replicas: `run` pools every request (for the bench summary); `replicas`
    holds each core's own statistics."""

    run: SimRun
    replicas: list[dict[str, Any]]

    def stats(self) -> dict[str, Any]:
        return self.run.stats() | {"replicas": self.replicas}


def simulate_data_parallel(
    requests: tuple[SimRequest, ...],
    cost_model: CostModel,
    scheduler_config: SchedulerConfig,
    num_blocks: int,
    num_replicas: int,
    block_size: int = 16,
    *,
    enable_prefix_caching: bool = True,
    router: str = "affinity",
    shared_prefixes: SharedPrefixes | None = None,
    policy: str = "continuous",
    layout: KVLayout | None = None,
    message_s: float = 0.0,
) -> DataParallelRun:
    """Continuous batching on `num_replicas` identical cores behind `router` (num_blocks each);
    `layout`: a hybrid model's KV groups, as the engine keeps them (kv/groups.py). `message_s`:
    the cores are on other hosts, one message one way takes this long: a request reaches its core
    that much after it arrives, and each delta reaches the client that much after its step ends."""
    if not message_s >= 0:
        raise SimError(f"a message's time must be >= 0, got {message_s}")
    if num_replicas < 1:
        raise SimError("need at least one replica")
    route = make_router(router)
    timelines = [RequestTimeline(r) for r in requests]
    by_id = {t.request_id: t for t in timelines}
    replicas = []
    for i in range(num_replicas):
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, layout)
        replica = Replica(i, Scheduler(scheduler_config, kv), kv, cost_model, by_id)
        replica.message_s = message_s
        replicas.append(replica)
    pending = sorted(timelines, key=lambda t: (t.request.arrival_s, t.request.index))
    for arrival_index, timeline in enumerate(pending):
        sim = timeline.request
        for replica in replicas:
            replica.advance_to(sim.arrival_s + message_s)
        timeline.error = validation_error(
            sim,
            scheduler_config.max_model_len,
            num_blocks,
            block_size,
            layout,
            scheduler_config.max_num_batched_tokens,
        )
        if timeline.error is not None:
            continue
        request = make_request(sim)
        if shared_prefixes is not None:
            request = replace(request, prompt_token_ids=shared_prefixes.token_ids(sim))
        block_hash = first_block_hash(request.prompt_token_ids, block_size)
        chosen = replicas[route(replicas, block_hash, arrival_index)]
        chosen.request_indices.append(sim.index)
        chosen.scheduler.add_request(request)
    for replica in replicas:
        replica.drain()
    run = SimRun(policy, timelines, num_blocks=num_blocks * num_replicas)
    run.num_steps = sum(r.num_steps for r in replicas)
    run.num_preemptions = sum(r.scheduler.stats.num_preemptions for r in replicas)
    run.busy_s = sum(r.busy_s for r in replicas) / num_replicas  # mean replica busy time
    run.end_s = max(r.now for r in replicas)
    run.peak_kv_usage = max(r.peak_kv_usage for r in replicas)
    return DataParallelRun(run, [r.stats() for r in replicas])


@dataclass(frozen=True)
class Layout:
    """One way to spend the devices: `data_parallel` replicas of `tensor_parallel` ranks."""

    tensor_parallel: int
    data_parallel: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        tp, sep, dp = text.strip().lower().partition("x")
        try:
            layout = cls(int(tp), int(dp)) if sep else None
        except ValueError:
            layout = None
        if layout is None or layout.tensor_parallel < 1 or layout.data_parallel < 1:
            raise SimError(f"a layout is TPxDP, e.g. 8x1 or 1x8; got {text!r}")
        return layout

    @property
    def name(self) -> str:
        return f"tp{self.tensor_parallel}x{self.data_parallel}"


def evaluate_data_parallel(
    policy: Policy,
    shape: EngineShape,
    cost_model: CostModel,
    requests: tuple[SimRequest, ...],
    rate: float | None,
    num_replicas: int,
    router: str = "affinity",
    shared_prefixes: SharedPrefixes | None = None,
    objective_sets: tuple[ObjectiveSet, ...] = (),
    usd_per_hour: float | None = None,
    message_s: float = 0.0,
) -> tuple[dict, DataParallelRun]:
    """`kvserve.lab.sim.study.evaluate` over M replicas: the same bench summary of the pooled
    records, with each replica's statistics under `sim.replicas`. `usd_per_hour` is the fleet's."""
    if policy.is_static:
        raise SimError("data-parallel simulation runs the continuous policies, not static")
    result = simulate_data_parallel(
        requests,
        cost_model,
        shape.scheduler_config(policy),
        shape.num_blocks,
        num_replicas,
        shape.block_size,
        enable_prefix_caching=shape.enable_prefix_caching,
        router=router,
        shared_prefixes=shared_prefixes,
        policy=policy.name,
        layout=shape.layout,
        message_s=message_s,
    )
    # the pooled records (result.run) summarised; each replica's statistics from result.stats()
    out = run_result(policy, result.run, rate, objective_sets, usd_per_hour)
    out["sim"] = result.stats()
    return out, result


def search_capacity_data_parallel(
    policy: Policy,
    source: Callable[[float], tuple[SimRequest, ...]],
    shape: EngineShape,
    cost_model: CostModel,
    num_replicas: int,
    objective_sets: tuple[ObjectiveSet, ...],
    router: str = "affinity",
    shared_prefixes: SharedPrefixes | None = None,
    min_attainment: float = 0.9,
    start_rps: float = 1.0,
    max_rps: float = 1024.0,
    rel_tol: float = 0.05,
    max_trials: int = 16,
    usd_per_hour: float | None = None,
    message_s: float = 0.0,
) -> dict:
    """`kvserve.lab.sim.study.search_capacity` over M replicas (the same search and pass rule)."""

    def run(rate: float) -> dict:
        return evaluate_data_parallel(
            policy,
            shape,
            cost_model,
            source(rate),
            rate,
            num_replicas,
            router,
            shared_prefixes,
            objective_sets,
            usd_per_hour,
            message_s,
        )[0]

    return capacity_search(
        policy.name, run, objective_sets, min_attainment, start_rps, max_rps, rel_tol, max_trials
    )
