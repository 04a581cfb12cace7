"""Calibration from a live server's own steps: the engine loop logs every iteration, the server
serves the log on /debug/steps, and the simulator fits it (with the request overhead)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from kvserve.lab.bench.records import RequestRecord, StreamEvent
from kvserve.lab.sim.cost import ChunkLoad, StepLoad, feature_vector
from kvserve.lab.sim.server_steps import (
    SERVER_FEATURES,
    fit_server_profile,
    loads_and_costs,
    machine_speed,
    pickup_s,
    request_overhead_s,
    timed_intake_s,
)
from kvserve.lab.sim.workload import SimError

# const, num_tokens, num_seqs, decode_context_tokens, prompt_attention_pairs, num_new_requests
TRUTH = (2e-3, 1e-5, 1e-3, 1e-7, 1e-8, 5e-3)


def synthetic_log(num: int = 200) -> dict:
    """Steps of a known cost (TRUTH over SERVER_FEATURES), split over the three phases of an
    iteration; some steps take a new request's prompt, some a later chunk of one."""
    steps, t, slept = [], 100.0, 0.0
    for i in range(num):
        chunks = [[1, 50 + 7 * i + 13 * j] for j in range(1 + i % 8)]
        if i % 3 == 0:
            chunks.append([5 + i % 17, 0])  # a new request
        elif i % 3 == 1:
            chunks.append([4 + i % 11, 32])  # a later chunk of a prompt
        load = StepLoad(tuple(ChunkLoad(n, c) for n, c in chunks))
        cost = float(np.dot(TRUTH, feature_vector(load, SERVER_FEATURES)))
        # a third of the cost is spent between the timed parts (the interpreter held elsewhere)
        steps.append(
            {"index": i, "t_start_s": t, "waited_s": slept, "commands_s": 0.1 * cost,
             "step_s": 0.5 * cost, "deliver_s": 0.1 * cost, "chunks": chunks}
        )  # fmt: skip
        slept = 0.5 if i % 10 == 9 else 0.0  # idle now and then: slept before the next one
        t += cost + slept
    steps.append({"index": num, "t_start_s": t, "waited_s": slept, "commands_s": 0, "step_s": 0,
                  "deliver_s": 0, "chunks": []})  # fmt: skip
    return {"engine": {"num_blocks": 99, "block_size": 16}, "steps": steps}


def test_a_step_costs_the_time_to_the_next_iteration_less_its_idle_sleep():
    loads, costs = loads_and_costs(synthetic_log(3)["steps"])
    assert len(loads) == 3
    assert loads[0] == StepLoad((ChunkLoad(1, 50), ChunkLoad(5, 0)))
    assert costs[0] == pytest.approx(
        float(np.dot(TRUTH, feature_vector(loads[0], SERVER_FEATURES)))
    )


def test_the_server_fit_recovers_the_intake_term_and_keeps_the_engine_limits():
    profile = fit_server_profile(synthetic_log(), overhead_s=0.012)
    coef = dict(zip(profile.features, profile.coef_s, strict=True))
    assert profile.features == SERVER_FEATURES
    assert profile.coef_s == pytest.approx(TRUTH, rel=1e-4)
    assert coef["num_new_requests"] == pytest.approx(5e-3, rel=1e-4)
    assert profile.meta["engine"]["num_blocks"] == 99
    assert profile.request_overhead_s == 0.012
    with pytest.raises(SimError, match="load it first"):
        fit_server_profile({"steps": []})


def test_the_profile_keeps_the_servers_own_intake_time_beside_the_fitted_term():
    """The fitted per-new-request cost and the intake the loop timed are reported side by side:
    here the log's commands take a tenth of each step, while the fit recovers the 5 ms truth."""
    doc = synthetic_log()
    rows = [r for r in doc["steps"] if any(c[1] == 0 for c in r["chunks"])]
    assert len(rows) == 67  # every third step takes one new request
    expected = sum(r["commands_s"] for r in rows) / len(rows)
    assert timed_intake_s(doc["steps"]) == pytest.approx(expected)
    profile = fit_server_profile(doc)
    assert profile.meta["intake_timed_s_per_request"] == pytest.approx(expected)
    assert timed_intake_s([{"chunks": [[1, 40]], "commands_s": 0.1}]) is None


def slowed(doc: dict, factor: float) -> dict:
    """The same log on a machine `factor` x slower: every timed part and gap stretched."""
    steps, t0 = [], doc["steps"][0]["t_start_s"]
    for s in doc["steps"]:
        s = dict(s)
        s["t_start_s"] = t0 + factor * (s["t_start_s"] - t0)
        for k in ("waited_s", "commands_s", "step_s", "deliver_s"):
            s[k] = factor * s[k]
        steps.append(s)
    return doc | {"steps": steps}


def test_machine_speed_measures_a_slower_machine_and_the_scaled_profile_matches_it():
    # calibrated on one log; the same steps later on a machine 25% slower (the shared-CPU drift
    # docs/simulator.md reports): the speed is 1.25 overall and in every step class
    doc = synthetic_log()
    profile = fit_server_profile(doc, overhead_s=0.01)
    same = machine_speed(profile, doc)
    assert same["mean_measured_over_predicted"] == pytest.approx(1.0, rel=1e-3)
    speed = machine_speed(profile, slowed(doc, 1.25))
    assert speed["mean_measured_over_predicted"] == pytest.approx(1.25, rel=1e-3)
    assert all(c["mean_measured_over_predicted"] == pytest.approx(1.25, rel=1e-3)
               for c in speed["by_class"].values())  # fmt: skip
    scaled = profile.scaled(speed["mean_measured_over_predicted"], "test")
    assert machine_speed(scaled, slowed(doc, 1.25))["mean_measured_over_predicted"] == (
        pytest.approx(1.0, rel=1e-3)
    )
    assert (
        scaled.request_overhead_s == 0.01
        and scaled.meta["scaled"]["factor"] == speed["mean_measured_over_predicted"]
    )
    with pytest.raises(ValueError, match="> 0"):
        profile.scaled(0.0, "bad")


def slowed_by_kind(doc: dict, prefill: float, decode: float) -> dict:
    """The same log where the steps with a prompt chunk ran `prefill` x slower and the
    decode-only steps `decode` x: each step's parts and its interval to the next stretched."""
    old = doc["steps"]
    factors = [prefill if any(n > 1 for n, _ in s["chunks"]) else decode for s in old]
    steps, t = [], old[0]["t_start_s"]
    for i, (s, factor) in enumerate(zip(old, factors, strict=True)):
        s = dict(s, t_start_s=t)
        for k in ("waited_s", "commands_s", "step_s", "deliver_s"):
            s[k] = factor * s[k]
        if i + 1 < len(old):  # this step's cost at its factor, the next one's sleep at the next's
            nxt = old[i + 1]
            busy = nxt["t_start_s"] - old[i]["t_start_s"] - nxt["waited_s"]
            t += factor * busy + factors[i + 1] * nxt["waited_s"]
        steps.append(s)
    return doc | {"steps": steps}


def test_the_speed_per_kind_of_step_and_the_profile_scaled_by_it():
    """One run of session 1206: the decode steps ran 1.19-1.30x the calibration, the prompt steps
    1.00-1.05x, and one speed number over-priced the prompt steps (TTFT p50 +13% and +18% at that
    speed). machine_speed reports each kind's speed, and the profile scaled per kind prices both."""
    from benchmarks._simval_speed import MIN_KIND_STEPS, kind_factors
    from kvserve.lab.sim.cost import STEP_KINDS, StepProfile

    doc = synthetic_log()
    profile = fit_server_profile(doc, overhead_s=0.01)
    run = slowed_by_kind(doc, prefill=1.05, decode=1.25)
    speed = machine_speed(profile, run)
    kinds = speed["by_kind"]
    assert kinds["prefill"]["mean_measured_over_predicted"] == pytest.approx(1.05, rel=1e-3)
    assert kinds["decode"]["mean_measured_over_predicted"] == pytest.approx(1.25, rel=1e-3)
    assert kinds["prefill"]["num_steps"] + kinds["decode"]["num_steps"] == speed["num_steps"]
    factors = kind_factors(speed)
    by_kind = profile.scaled_by_kind(factors, "test")
    after = machine_speed(by_kind, run)["by_kind"]
    assert all(after[k]["mean_measured_over_predicted"] == pytest.approx(1.0, rel=1e-3)
               for k in STEP_KINDS)  # fmt: skip
    # one number leaves each kind off by its own drift
    one = machine_speed(profile.scaled(speed["mean_measured_over_predicted"], "t"), run)["by_kind"]
    assert one["prefill"]["mean_measured_over_predicted"] < 0.95
    assert one["decode"]["mean_measured_over_predicted"] > 1.05
    # saved and loaded, and composed with a second scaling; the overheads kept
    again = StepProfile.from_dict(by_kind.to_dict()).scaled_by_kind(
        {"prefill": 2.0, "decode": 1.0}, "twice"
    )
    assert again.meta["scaled_by_kind"]["factors"]["prefill"] == pytest.approx(2.1)
    assert again.request_overhead_s == 0.01
    assert again.meta["scaled_by_kind"]["why"] == "test; then twice"
    broken = by_kind.to_dict()
    broken["scaled_by_kind"] = {"factors": {"prefill": 1.0}}
    with pytest.raises(ValueError, match="scaled_by_kind"):
        StepProfile.from_dict(broken)  # refused on reading, not at the first step priced
    with pytest.raises(ValueError, match="> 0"):
        profile.scaled_by_kind({"prefill": 1.0}, "a kind missing")
    with pytest.raises(ValueError, match="> 0"):
        profile.scaled_by_kind({"prefill": 1.0, "decode": 0.0}, "bad")
    # a kind with too few steps in the run takes the run's one number
    few = speed | {"by_kind": {"decode": kinds["decode"],
                               "prefill": {"num_steps": MIN_KIND_STEPS - 1,
                                           "mean_measured_over_predicted": 3.0}}}  # fmt: skip
    assert kind_factors(few)["prefill"] == speed["mean_measured_over_predicted"]


def test_request_overhead_is_the_client_server_ttft_gap():
    def rec(i, client_ttft, server_ttft):
        return RequestRecord(
            f"r{i}", i, "measured", "ok", 0.0, 1.0, 2.0, 4,
            events=(StreamEvent(1.0 + client_ttft, 2, 1),),
            extra={"server_metrics": {"ttft_s": server_ttft}},
        )  # fmt: skip

    records = [rec(0, 0.10, 0.09), rec(1, 0.20, 0.17), rec(2, 0.30, 0.29)]
    assert request_overhead_s(records) == pytest.approx(0.01)


def test_overhead_delays_simulated_ttft_by_exactly_itself():
    from kvserve.lab.sim.cost import StepProfile
    from kvserve.lab.sim.study import EngineShape, Policy, evaluate
    from kvserve.lab.sim.workload import SimRequest

    shape = EngineShape(num_blocks=500, max_model_len=512, max_num_seqs=4, chunk_tokens=64)
    requests = (SimRequest(0, 0.0, 10, 5), SimRequest(1, 1.0, 10, 5))
    base = StepProfile(("const",), (0.01,))
    slow = StepProfile(("const",), (0.01,), {"request_overhead_s": 0.05})
    a, _ = evaluate(Policy.parse("on_demand-chunked"), shape, base, requests, None)
    b, _ = evaluate(Policy.parse("on_demand-chunked"), shape, slow, requests, None)
    ta, tb = a["summary"]["latency_s"]["ttft"], b["summary"]["latency_s"]["ttft"]
    assert tb["p50"] == pytest.approx(ta["p50"] + 0.05)


def test_pickup_is_the_lowest_decile_of_the_servers_queue_times():
    def rec(i, queue):
        return RequestRecord(f"r{i}", i, "measured", "ok", 0.0, 1.0, 2.0, 4,
                             extra={"server_metrics": {"queue_time_s": queue}})  # fmt: skip

    queues = [0.001 + 0.0001 * i for i in range(10)] + [0.5] * 10  # idle arrivals, then queued
    assert pickup_s([rec(i, q) for i, q in enumerate(queues)]) == pytest.approx(
        0.00119
    )  # 10th percentile, interpolated
    assert pickup_s([rec(i, 0.001) for i in range(9)]) is None  # too few to say
    failed = RequestRecord("x", 9, "measured", "failed", 0.0, 1.0, 2.0, 4,
                           extra={"server_metrics": {"queue_time_s": 0.0}})  # fmt: skip
    assert pickup_s([rec(i, 0.002) for i in range(10)] + [failed]) == pytest.approx(0.002)


def test_a_burst_within_the_idle_engines_pickup_shares_its_first_step():
    """The saturating replay of session 1206: 60 requests sent within 3 ms reached the server's idle
    engine ~1-8 ms later, and its first step held 4 prompts; the simulated engine started on the
    first arrival alone and carried decodes through one more large prompt step. With the
    measured pickup (1.2 ms at light load) the burst joins one step, and a lone request's TTFT
    grows by the pickup exactly."""
    from kvserve.lab.sim.cost import StepProfile
    from kvserve.lab.sim.loop import simulate_continuous
    from kvserve.lab.sim.study import EngineShape, Policy, evaluate
    from kvserve.lab.sim.workload import SimRequest

    shape = EngineShape(num_blocks=500, max_model_len=512, max_num_seqs=8, chunk_tokens=512)
    burst = tuple(SimRequest(i, 0.0003 * i, 40, 3) for i in range(4))
    first_steps = {}
    for pickup in (0.0, 0.0012):
        profile = StepProfile(("const", "num_tokens"), (0.01, 1e-4), {"pickup_s": pickup})
        seen = []
        policy = Policy.parse("on_demand-chunked")
        simulate_continuous(burst, profile, shape.scheduler_config(policy), shape.num_blocks,
                            on_step=lambda kv, out, now, seen=seen: seen.append(len(out.chunks)))  # fmt: skip
        first_steps[pickup] = seen[0]
    assert first_steps == {0.0: 1, 0.0012: 4}
    lone = (SimRequest(0, 0.0, 10, 5), SimRequest(1, 1.0, 10, 5))
    ttft = {}
    for pickup in (0.0, 0.003):
        profile = StepProfile(("const",), (0.01,), {"pickup_s": pickup})
        doc, _ = evaluate(Policy.parse("on_demand-chunked"), shape, profile, lone, None)
        ttft[pickup] = doc["summary"]["latency_s"]["ttft"]["p50"]
    assert ttft[0.003] == pytest.approx(ttft[0.0] + 0.003)


def test_a_live_server_logs_its_steps_and_the_cli_fits_them(gpt2_model_dir, tmp_path, capsys):
    from kvserve.cli import main
    from tests.server_utils import running_server

    with running_server(gpt2_model_dir, "--max-model-len", "256") as (base_url, _):
        start = httpx.get(f"{base_url}/debug/steps", params={"since": 10**9}).json()
        assert start["steps"] == [] and start["engine"]["max_model_len"] == 256
        with httpx.Client(base_url=base_url, timeout=60) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            for i in range(8):
                body = {"model": model, "prompt": [5 + i] * (10 + 7 * i), "max_tokens": 6,
                        "ignore_eos": True}  # fmt: skip
                assert http.post("/v1/completions", json=body).status_code == 200
        doc = httpx.get(f"{base_url}/debug/steps", params={"since": start["num_recorded"]}).json()
    rows = [r for r in doc["steps"] if r["chunks"]]
    assert len(rows) >= 8 * 6  # one step per output token at least
    assert all(r["step_s"] > 0 and r["commands_s"] >= 0 and r["deliver_s"] >= 0 for r in rows)
    assert sum(c[0] for r in rows for c in r["chunks"]) >= sum(10 + 7 * i for i in range(8))
    # (new tokens, start, what it samples: 1 the first output token, 2 a later one, proposals)
    kinds = [c[2] for r in rows for c in r["chunks"]]
    assert kinds.count(1) == 8 and kinds.count(2) == 8 * 5
    assert all(len(c) == 4 and c[3] == 0 for r in rows for c in r["chunks"])
    saved = tmp_path / "steps.json"
    saved.write_text(json.dumps(doc))
    profile = tmp_path / "p.json"
    args = ["simulate", "--calibrate-server", str(saved), "--save", str(profile)]
    assert main(args + ["--accept-poor-fit"]) == 0
    fit = json.loads(profile.read_text())
    assert fit["fit"]["num_steps"] == len(rows) and fit["engine"]["max_model_len"] == 256
    assert "server fit over" in capsys.readouterr().out
