"""Simulator workloads, calibrated profiles, metrics, capacity search, cost and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.lab.bench.arrivals import ArrivalSpec, schedule
from kvserve.lab.bench.records import RequestRecord, StreamEvent, write_jsonl
from kvserve.lab.bench.slo import ObjectiveSet
from kvserve.lab.bench.tokenization import ApproxTokenizer, PromptFitter
from kvserve.lab.bench.workloads import LengthDist, WorkloadSpec, build_workload
from kvserve.lab.sim.cost import (
    DEFAULT_FEATURES,
    ChunkLoad,
    StepLoad,
    StepProfile,
    feature_vector,
)
from kvserve.lab.sim.fit import fit_profile
from kvserve.lab.sim.study import EngineShape, Policy, evaluate, search_capacity
from kvserve.lab.sim.workload import (
    SimError,
    SimRequest,
    Workload,
    nominal_rate,
    requests_from_trace,
)
from tests.lab.test_sim import smol_cost


def test_synthetic_workload_is_the_bench_random_workload():
    input_len, output_len = LengthDist("uniform", 20, 60), LengthDist("lognormal", 30, 0.5, 4, 90)
    workload = Workload(input_len, output_len, num_requests=12, num_warmup=2, seed=7)
    spec = WorkloadSpec("random", input_len, output_len, seed=7)
    bench = build_workload(spec, 14, PromptFitter(ApproxTokenizer()))
    sim = workload.requests(3.0)
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in sim] == [
        (b.num_prompt_tokens, b.max_tokens) for b in bench
    ]
    offsets = schedule(ArrivalSpec("gamma", 3.0), 7, 2, 12, None)
    assert [r.arrival_s for r in sim] == list(offsets)
    assert [r.phase for r in sim] == ["warmup"] * 2 + ["measured"] * 12
    assert all(r.arrival_s == 0.0 for r in workload.requests(float("inf")))
    # Common random numbers: doubling the rate halves every arrival time.
    fast = workload.requests(6.0)
    assert [f.arrival_s for f in fast] == pytest.approx([r.arrival_s / 2 for r in sim])


def test_trace_from_bench_records_replays_sends_and_server_counts(tmp_path):
    def rec(i, t, outcome, completion):
        return RequestRecord(
            request_id=f"r{i}",
            index=i,
            phase="warmup" if i == 0 else "measured",
            outcome=outcome,
            t_scheduled_s=t,
            t_send_s=t + 0.01,
            t_end_s=t + 1,
            max_tokens=64,
            events=(StreamEvent(t + 0.5, 3, 1),),
            num_prompt_tokens_client=90,
            num_prompt_tokens_server=100 + i,
            num_completion_tokens_server=completion,
        )

    path = tmp_path / "requests.jsonl"
    write_jsonl(path, [rec(0, 5.0, "ok", 40), rec(1, 6.0, "ok", 64), rec(2, 7.5, "timeout", None)])
    reqs = requests_from_trace(path, LengthDist("fixed", 1), LengthDist("fixed", 1))
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens, r.phase) for r in reqs] == [
        (0.0, 100, 40, "warmup"),
        (pytest.approx(1.0), 101, 64, "measured"),
        (pytest.approx(2.5), 102, 64, "measured"),  # not completed: its max_tokens
    ]
    assert nominal_rate(reqs) == pytest.approx(1 / 1.5)


def test_arrival_trace_fills_missing_lengths_from_the_distributions(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 10}\n{"timestamp": 10.5, "input_len": 7, "output_len": 3}\n')
    reqs = requests_from_trace(path, LengthDist("fixed", 11), LengthDist("fixed", 5))
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in reqs] == [
        (0.0, 11, 5),
        (0.5, 7, 3),
    ]
    with pytest.raises(SimError):
        requests_from_trace(
            tmp_path / "missing.jsonl", LengthDist("fixed", 1), LengthDist("fixed", 1)
        )


def test_fit_profile_recovers_a_known_linear_step_cost(tmp_path):
    rng = np.random.default_rng(0)
    truth = dict(zip(DEFAULT_FEATURES, (2e-3, 5e-6, 1e-4, 3e-8, 1e-9), strict=True))
    loads, times = [], []
    for _ in range(200):
        chunks = [ChunkLoad(1, int(rng.integers(0, 2000))) for _ in range(int(rng.integers(0, 30)))]
        if rng.random() < 0.3:
            chunks.append(ChunkLoad(int(rng.integers(2, 500)), int(rng.integers(0, 500))))
        load = StepLoad(tuple(chunks) or (ChunkLoad(1, 0),))
        loads.append(load)
        times.append(float(np.dot(list(truth.values()), feature_vector(load, DEFAULT_FEATURES))))
    profile = fit_profile(loads, times, meta={"engine": {"num_blocks": 77, "block_size": 8}})
    assert profile.coef_s == pytest.approx(tuple(truth.values()), rel=1e-6)
    assert profile.meta["fit"]["max_abs_rel_error"] < 1e-9
    again = StepProfile.load(profile.save(tmp_path / "p.json"))
    assert again == profile and again.meta["engine"]["num_blocks"] == 77
    assert again.load_s(loads[0]) == pytest.approx(times[0])


def test_fit_profile_predicts_the_mean_step_time_under_multiplicative_noise():
    # A noisy machine: each step takes 1x or 2x its cost (mean 1.5x). The fit must track the mean,
    # not the fast samples, or every simulated latency comes out short.
    rng = np.random.default_rng(1)
    loads, times = [], []
    for _ in range(2000):
        batch = int(rng.integers(1, 32))
        load = StepLoad(tuple(ChunkLoad(1, int(rng.integers(0, 1000))) for _ in range(batch)))
        base = 0.01 + 0.001 * batch + 1e-6 * sum(c.num_cached_tokens + 1 for c in load.chunks)
        loads.append(load)
        times.append(base * (1.0 if rng.random() < 0.5 else 2.0))
    profile = fit_profile(loads, times)
    predicted = np.array([profile.load_s(s) for s in loads])
    assert np.mean(np.array(times) / predicted) == pytest.approx(1.0, abs=0.02)
    assert profile.meta["fit"]["mean_measured_over_predicted"] == pytest.approx(1.0, abs=0.02)


def test_fit_profile_never_returns_negative_costs():
    # Steps whose time falls with the batch: least squares would give num_seqs a negative cost.
    loads = [StepLoad((ChunkLoad(1, 10),) * b) for b in range(1, 20)]
    times = [0.01 - 1e-4 * b for b in range(1, 20)]
    profile = fit_profile(loads, times)
    assert min(profile.coef_s) >= 0.0


def small_shape() -> EngineShape:
    return EngineShape(num_blocks=4000, max_model_len=2048, max_num_seqs=16, chunk_tokens=256)


def small_workload() -> Workload:
    return Workload(LengthDist("uniform", 200, 600), LengthDist("uniform", 20, 80), 60, seed=1)


def test_evaluate_reports_spec_metrics_goodput_and_cost_from_simulated_throughput():
    slo = ObjectiveSet.parse("ttft=50ms,worst_gap=20ms")
    requests = small_workload().requests(20.0)
    result, run = evaluate(
        Policy.parse("on_demand-chunked"),
        small_shape(),
        smol_cost(0.001),
        requests,
        20.0,
        (slo,),
        usd_per_hour=2.0,
    )
    s = result["summary"]
    records = run.records()
    total_out = sum(r.num_output_tokens for r in requests)
    window = max(r.t_end_s for r in records) - min(r.t_send_s for r in records)
    assert s["throughput"]["total_output_tokens"] == total_out
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(total_out / window)
    assert s["latency_s"]["ttft"]["count"] == 60
    assert s["latency_s"]["itl"]["count"] == total_out - 60  # one gap per token after the first
    assert s["arrivals"]["nominal_rate_rps"] == 20.0
    assert s["goodput"][0]["name"] == slo.name
    expected = 2.0 / (s["throughput"]["output_tokens_per_s"] * 3600) * 1e6
    assert result["cost"]["usd_per_million_output"] == pytest.approx(expected)
    assert result["sim"]["num_steps"] == run.num_steps > 0


def test_cost_per_token_falls_as_the_rate_fills_the_device():
    requests = small_workload()
    costs = [
        evaluate(
            Policy.parse("on_demand"),
            small_shape(),
            smol_cost(0.001),
            requests.requests(r),
            r,
            usd_per_hour=1.0,
        )[0]["cost"]["usd_per_million_output"]
        for r in (2.0, 50.0)
    ]
    assert costs[0] > 2 * costs[1]


def test_find_capacity_is_the_highest_passing_rate():
    slo = ObjectiveSet.parse("p99_ttft=40ms")
    workload = small_workload()
    out = search_capacity(
        Policy.parse("on_demand-chunked"),
        workload.requests,
        small_shape(),
        smol_cost(0.002),
        (slo,),
        start_rps=4.0,
        max_rps=512.0,
        rel_tol=0.1,
        max_trials=14,
    )
    capacity = out["capacity_rps"]
    assert capacity is not None and not out["lower_bound_only"]
    trials = out["trials"]
    assert all(t["passed"] for t in trials if t["rate"] <= capacity)
    assert any(not t["passed"] for t in trials if t["rate"] > capacity)
    assert out["at_capacity"]["ttft_p99_s"] <= 0.040


def test_policy_names():
    assert Policy.parse("on-demand-chunked") == Policy("on_demand-chunked", "on_demand", True)
    assert Policy.parse("static").is_static
    with pytest.raises(SimError, match="unknown policy"):
        Policy.parse("greedy")


def test_requests_larger_than_the_cache_fail_like_the_engine_rejects_them():
    shape = EngineShape(num_blocks=10, max_model_len=4096, block_size=16)
    requests = (SimRequest(0, 0.0, 100, 20), SimRequest(1, 0.0, 400, 20))
    result, run = evaluate(Policy.parse("on_demand"), shape, smol_cost(), requests, None)
    assert [r.outcome for r in run.records()] == ["ok", "failed"]
    assert result["summary"]["counts"]["failed"] == 1


def test_cli_sweep_json_plot_and_bench_format_records(tmp_path, capsys):
    from kvserve.cli import main
    from kvserve.lab.bench.compare import load_run

    plot = tmp_path / "rates.png"
    code = main(
        [
            "simulate",
            "SmolLM2-135M",
            "--hardware",
            "l4",
            "--num-requests",
            "20",
            "--input-len",
            "uniform:100:300",
            "--output-len",
            "30",
            "--request-rate",
            "5,inf",
            "--policy",
            "static,on_demand-chunked",
            "--slo",
            "ttft=1s",
            "--json",
            "--plot",
            str(plot),
            "--records-dir",
            str(tmp_path / "runs"),
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["nominal_rate_rps"]) for r in doc["runs"]] == [
        ("static", 5.0),
        ("on_demand-chunked", 5.0),
        ("static", "inf"),
        ("on_demand-chunked", "inf"),
    ]
    assert doc["deployment"]["hardware"] == "L4" and doc["price"]["usd_per_hour"] == 0.8
    assert doc["runs"][1]["summary"]["throughput"]["total_output_tokens"] == 600
    assert plot.stat().st_size > 0
    summary, records = load_run(tmp_path / "runs" / "on_demand-chunked_rate_5")
    assert len(records) == 20 and summary["source"] == "kvserve simulate"


def test_cli_errors_are_messages_not_tracebacks(capsys):
    from kvserve.cli import main

    assert main(["simulate", "NoSuchModel"]) == 2
    assert "NoSuchModel" in capsys.readouterr().err
    assert main(["simulate", "SmolLM2-135M", "--policy", "fifo", "--num-requests", "2"]) == 2
    assert "unknown policy" in capsys.readouterr().err
