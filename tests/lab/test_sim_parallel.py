"""The simulator over more than one device (docs/parallel.md): the tensor-parallel communication
term, data-parallel replicas behind a router, and `kvserve simulate --parallel`."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.cli import simulate as simulate_cli
from kvserve.config import SchedulerConfig
from kvserve.lab.bench.workloads import LengthDist
from kvserve.lab.plan import arith, get_profile, load_model, make_plan
from kvserve.lab.plan.parallel import INTERCONNECTS, Parallelism
from kvserve.lab.sim.cost import ChunkLoad, RooflineStepCost, StepLoad
from kvserve.lab.sim.loop import simulate_continuous
from kvserve.lab.sim.parallel import (
    Layout,
    SharedPrefixes,
    evaluate_data_parallel,
    first_block_hash,
    make_router,
    simulate_data_parallel,
    tensor_parallel_deployment,
)
from kvserve.lab.sim.study import EngineShape, Policy, evaluate
from kvserve.lab.sim.workload import SimError, SimRequest, Workload

BLOCK = 4
NVLINK = INTERCONNECTS["nvlink4"]
H100 = get_profile("h100-sxm")


def smol_cost() -> RooflineStepCost:
    model = load_model("SmolLM2-135M")
    k = arith.kv_bytes_per_token(model, 2)
    return RooflineStepCost(arith.RooflineCost(model, model.num_params * 2.0, k, 1e12, 1e14, 0.5))


def config(budget: int = 24) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=128)


def workload_requests(n: int = 40, rate: float = 2000.0, seed: int = 3) -> tuple[SimRequest, ...]:
    w = Workload(LengthDist("uniform", 8, 60), LengthDist("uniform", 4, 40), n, seed=seed)
    return w.requests(rate)


def records(run) -> list[dict]:
    return [r.to_json() for r in run.records()]


def test_one_replica_is_exactly_the_single_engine_loop():
    requests = workload_requests()
    alone = simulate_continuous(requests, smol_cost(), config(), 60, BLOCK)
    dp = simulate_data_parallel(requests, smol_cost(), config(), 60, 1, BLOCK)
    assert records(dp.run) == records(alone)
    assert alone.num_preemptions > 0  # the small cache exercises preemption too
    assert dp.run.num_preemptions == alone.num_preemptions
    assert dp.run.num_steps == alone.num_steps


@pytest.mark.parametrize("router", ["least-loaded", "round-robin", "affinity"])
def test_replicas_are_independent_engines(router):
    """Each replica, given the requests the router sent it, behaves exactly as one engine alone."""
    requests = workload_requests(60)
    dp = simulate_data_parallel(requests, smol_cost(), config(), 60, 3, BLOCK, router=router)
    by_index = {r.index: r for r in requests}
    pooled = {rec["request_id"]: rec for rec in records(dp.run)}
    sizes = []
    for replica in dp.replicas:
        subset = tuple(by_index[i] for i in replica["request_indices"])
        sizes.append(len(subset))
        alone = simulate_continuous(subset, smol_cost(), config(), 60, BLOCK)
        assert records(alone) == [pooled[rec["request_id"]] for rec in records(alone)]
    assert sum(sizes) == len(requests) and min(sizes) > 0


def test_least_loaded_and_round_robin_by_hand():
    # Three requests at t=0 on 2 replicas: least loaded sends 0 -> r0, 1 -> r1, 2 -> r0 (tie: lowest);
    # a fourth long after all finished goes to r0 again (both empty).
    requests = tuple(SimRequest(i, t, 10, 5) for i, t in enumerate((0.0, 0.0, 0.0, 100.0)))
    dp = simulate_data_parallel(
        requests, smol_cost(), config(), 60, 2, BLOCK, router="least-loaded"
    )
    assert [r["request_indices"] for r in dp.replicas] == [[0, 2, 3], [1]]
    rr = simulate_data_parallel(requests, smol_cost(), config(), 60, 2, BLOCK, router="round-robin")
    assert [r["request_indices"] for r in rr.replicas] == [[0, 2], [1, 3]]
    with pytest.raises(SimError, match="unknown router"):
        make_router("random")


def test_affinity_keeps_each_prefix_on_one_replica_and_its_cache_hits():
    shared = SharedPrefixes(num_groups=3, num_tokens=24)
    requests = tuple(SimRequest(i, 0.0, 40, 6) for i in range(30))
    # the shared prefix really is shared: same first-block hash within a group, not across
    ids = [shared.token_ids(r) for r in requests[:6]]
    assert ids[0][:24] == ids[3][:24] and ids[0][24:] != ids[3][24:]
    assert first_block_hash(ids[0], BLOCK) == first_block_hash(ids[3], BLOCK)
    assert first_block_hash(ids[0], BLOCK) != first_block_hash(ids[1], BLOCK)

    def run(router: str, num_replicas: int):
        return simulate_data_parallel(
            requests,
            smol_cost(),
            config(),
            200,
            num_replicas,
            BLOCK,
            router=router,
            shared_prefixes=shared,
        )

    # the burst's first three requests (groups 0, 1, 2) go to the least loaded replicas 0, 1, 2;
    # every later request follows its group's first block
    affinity = run("affinity", 3)
    assert [r["request_indices"] for r in affinity.replicas] == [
        list(range(g, 30, 3)) for g in range(3)
    ]

    # on 2 replicas round-robin splits every group over both, so each prefix is computed twice
    def hit_tokens(dp) -> float:
        return sum(r["prefix_cache_hit_rate"] * r["num_requests"] for r in dp.replicas)

    assert hit_tokens(run("affinity", 2)) > hit_tokens(run("round-robin", 2))


def test_tensor_parallel_step_is_the_planners_decode_step_plus_all_reduces():
    model = load_model("Llama-3.1-70B")
    dep = tensor_parallel_deployment(model, H100, Parallelism(8, 1, NVLINK))
    plan = make_plan(model, H100, "bf16", parallel=Parallelism(8, 1, NVLINK))
    t = 2250
    decode = StepLoad((ChunkLoad(1, t - 1),))
    assert dep.cost_model.load_s(decode) == pytest.approx(plan.latency.tpot_solo_s, rel=1e-12)
    # by hand: one rank's weights and KV over 0.8 x 3.35 TB/s, 161 all-reduces of 16 kB (each
    # 2 x 7/8 x 16384 / 450e9 + 14 us) and the gather of 128,256 bf16 logits (7/8 of them + 7 us)
    memory_s = (17_640_734_720 + 40_960 * t) / (3350e9 * 0.8)
    comm_s = 161 * (2 * 7 / 8 * 16_384 / 450e9 + 14e-6) + 7 / 8 * 128_256 * 2 / 450e9 + 7e-6
    assert dep.cost_model.load_s(decode) == pytest.approx(memory_s + comm_s, rel=1e-12)
    # every rank caches the same tokens: the replica's cache is one device's free memory over one
    # rank's k = 40,960 B per token
    assert dep.kv_bytes_per_token == 40_960
    assert dep.kv_cache_bytes == pytest.approx(80e9 - 17_640_734_720 - 2e9)
    # one device: no communication at all
    one = tensor_parallel_deployment(load_model("Llama-3.1-8B"), H100, Parallelism(1, 8, NVLINK))
    assert one.cost_model.roofline.comm is None


def test_evaluate_on_one_replica_matches_the_study():
    shape = EngineShape(num_blocks=60, max_model_len=128, block_size=BLOCK, max_num_seqs=4)
    policy = Policy.parse("on_demand-chunked")
    requests = workload_requests()
    ours, _ = evaluate_data_parallel(policy, shape, smol_cost(), requests, 2000.0, 1)
    theirs, _ = evaluate(policy, shape, smol_cost(), requests, 2000.0)
    assert ours["summary"] == theirs["summary"]
    with pytest.raises(SimError, match="continuous"):
        evaluate_data_parallel(Policy.parse("static"), shape, smol_cost(), requests, 1.0, 2)


def test_layout_parse():
    assert Layout.parse("8x1") == Layout(8, 1) and Layout.parse("1X8").name == "tp1x8"
    for bad in ("8", "0x2", "ax1", "2x"):
        with pytest.raises(SimError):
            Layout.parse(bad)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    simulate_cli.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


COMMON = [
    "Llama-3.1-8B",
    "--input-len",
    "uniform:1000:3000",
    "--output-len",
    "100",
    "--num-requests",
    "60",
    "--policy",
    "on_demand-chunked",
]


def test_cli_compares_tp8_with_eight_replicas(capsys):
    rc, out, _ = run_cli(
        COMMON
        + ["--parallel", "1x8,8x1", "--request-rate", "0.5,inf", "--max-num-seqs", "8", "--json"],
        capsys,
    )
    assert rc == 0
    doc = json.loads(out)
    assert [d["layout"] for d in doc["deployments"]] == ["tp1x8", "tp8x1"]
    runs = {(r["policy"], r["nominal_rate_rps"]): r for r in doc["runs"]}
    light_dp = runs[("on_demand-chunked tp1x8", 0.5)]["summary"]["latency_s"]
    light_tp = runs[("on_demand-chunked tp8x1", 0.5)]["summary"]["latency_s"]
    # light load: one request at a time reads 1/8 of the weights per step on TP 8
    assert light_tp["itl"]["p50"] < light_dp["itl"]["p50"] / 2
    assert light_tp["ttft"]["p50"] < light_dp["ttft"]["p50"]
    # saturation: eight replicas run 8 x 8 sequences at once, one TP group only 8
    sat = {
        k[0]: r["summary"]["throughput"]["output_tokens_per_s"]
        for k, r in runs.items()
        if k[1] == "inf"  # json_safe writes infinity as a string
    }
    assert sat["on_demand-chunked tp1x8"] > sat["on_demand-chunked tp8x1"]
    # both layouts pay for 8 devices
    assert doc["price"]["usd_per_device_hour"] == 3.0
    replicas = runs[("on_demand-chunked tp1x8", 0.5)]["sim"]["replicas"]
    assert len(replicas) == 8 and sum(r["num_requests"] for r in replicas) == 60


def test_cli_text_and_errors(capsys):
    rc, out, _ = run_cli(COMMON + ["--parallel", "2x1", "--shared-prefix", "4:256"], capsys)
    assert rc == 0
    assert "tp2x1: Llama-3.1-8B on 2 x H100 SXM" in out and "shared prefix 4:256" in out
    rc, _, err = run_cli(COMMON + ["--parallel", "3x1"], capsys)
    assert rc == 2 and "must divide" in err
    rc, _, err = run_cli(COMMON + ["--parallel", "2x2", "--policy", "static"], capsys)
    assert rc == 2 and "continuous" in err


def test_capacity_search_on_one_replica_is_the_studys():
    from kvserve.lab.bench.slo import ObjectiveSet
    from kvserve.lab.sim.parallel import search_capacity_data_parallel
    from kvserve.lab.sim.study import search_capacity

    shape = EngineShape(num_blocks=60, max_model_len=128, block_size=BLOCK, max_num_seqs=4)
    policy = Policy.parse("on_demand-chunked")
    slo = (ObjectiveSet.parse("p99_ttft=40ms"),)

    def source(rate: float) -> tuple[SimRequest, ...]:
        return workload_requests(n=24, rate=rate)

    search = dict(start_rps=4.0, max_rps=512.0, rel_tol=0.1, max_trials=12)
    ours = search_capacity_data_parallel(policy, source, shape, smol_cost(), 1, slo, **search)
    theirs = search_capacity(policy, source, shape, smol_cost(), slo, **search)
    assert ours == theirs
    assert ours["trials"] and any(t["passed"] for t in ours["trials"])
    with pytest.raises(SimError, match="objective set"):
        search_capacity_data_parallel(policy, source, shape, smol_cost(), 2, (), **search)


def test_remote_cores_shift_every_token_by_two_messages():
    """Requests far apart (one at a time): each reaches its core `message_s` after arriving and each
    token reaches the client `message_s` after its step, so TTFT and E2E grow by exactly 2 x
    message_s and the gaps between tokens do not change."""
    requests = workload_requests(n=8, rate=2.0)
    local = simulate_data_parallel(requests, smol_cost(), config(), 60, 2, BLOCK)
    remote = simulate_data_parallel(requests, smol_cost(), config(), 60, 2, BLOCK, message_s=1e-3)
    for a, b in zip(local.run.timelines, remote.run.timelines, strict=True):
        assert len(a.token_times_s) == len(b.token_times_s) > 1
        arrival = a.request.arrival_s
        assert b.token_times_s[0] - arrival == pytest.approx(a.token_times_s[0] - arrival + 2e-3)
        assert [t - b.token_times_s[0] for t in b.token_times_s] == pytest.approx(
            [t - a.token_times_s[0] for t in a.token_times_s]
        )
    with pytest.raises(SimError, match="must be >= 0"):
        simulate_data_parallel(requests, smol_cost(), config(), 60, 2, BLOCK, message_s=-1.0)


def test_cli_remote_core_latency_moves_ttft_not_itl(capsys):
    argv = [*COMMON, "--parallel", "1x2", "--request-rate", "0.5", "--json"]
    summaries = []
    for extra in ([], ["--remote-core-latency-us", "2000"]):
        rc, out, _ = run_cli(argv + extra, capsys)
        assert rc == 0
        doc = json.loads(out)
        summaries.append(doc["runs"][0]["summary"]["latency_s"])
    assert doc["deployments"][0]["remote_core_message_s"] == 2e-3
    local, remote = summaries
    assert remote["ttft"]["p50"] == pytest.approx(local["ttft"]["p50"] + 4e-3, rel=1e-6)
    assert remote["itl"]["p50"] == pytest.approx(local["itl"]["p50"], rel=1e-9)
