"""Delivery jitter (kvserve.lab.sim.delivery, docs/simulator.md): calibrated by matching each token a
client received to the step that sampled it in the server's step log, on synthetic runs with a
known jitter and clock offset; drawn per token in the simulator, in order, seeded."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.lab.bench.records import RequestRecord, StreamEvent
from kvserve.lab.sim.delivery import DeliveryJitter, delivery_jitter

OFFSET_S = -5000.0  # client clock - server clock
STEP_S = 5e-3


def synthetic_run(jitter_scale_s: float, seed: int = 0, num_requests: int = 40, tokens: int = 20):
    """Requests one after another, each a prompt step then decode steps of STEP_S; the client
    receives every token at its step's end + OFFSET_S + an exponential delay. Another run's
    steps (the same chunk keys, a minute earlier, another pace) are in the log too, as in a
    calibration log of two runs."""
    rng = np.random.default_rng(seed)
    steps, records, delays = [], [], []
    for run, t0, spacing_s, step_s in ((0, 0.0, 0.7, 7e-3), (1, 60.0, 1.0, STEP_S)):
        for i in range(num_requests):
            prompt = 30 + i % 15  # lengths repeat: several candidates per token
            t = t0 + spacing_s * i
            ends = []
            for j in range(tokens):
                chunk = [prompt, 0] if j == 0 else [1, prompt + j - 1]
                steps.append({"index": len(steps), "t_start_s": t, "waited_s": 0.0,
                              "commands_s": 0.0, "step_s": step_s, "deliver_s": 0.0,
                              "chunks": [chunk]})  # fmt: skip
                t += step_s
                ends.append(t)
            if run == 1:
                ends_s = np.asarray(ends)
                # received in order: a late token holds the next one back
                received = np.maximum.accumulate(ends_s + rng.exponential(jitter_scale_s, tokens))
                delays += list(received - ends_s)
                events = tuple(StreamEvent(t + OFFSET_S, 3, k + 1) for k, t in enumerate(received))
                records.append(RequestRecord(f"r{i}", i, "measured", "ok", 0.0, 0.0, 1.0, tokens,
                                             events=events, num_prompt_tokens_server=prompt))  # fmt: skip
    steps.sort(key=lambda r: r["t_start_s"])
    return records, steps, np.asarray(delays)


def test_the_jitter_is_recovered_from_the_step_log_whatever_the_clock_offset():
    records, steps, delays = synthetic_run(2e-3)
    got = delivery_jitter(records, steps)
    assert got is not None and got["num_tokens"] == len(delays)
    q = np.asarray(got["quantiles"])
    assert q[50] == pytest.approx(0.0, abs=1e-12)  # centred on the median delay
    expected = np.percentile(delays, [10, 90, 99]) - np.median(delays)
    assert q[[10, 90, 99]] == pytest.approx(expected, abs=2e-4)
    assert got["median_delay_s"] == pytest.approx(OFFSET_S + np.median(delays), abs=5e-4)
    assert abs(got["lag1_correlation"]) < 0.2  # independent draws


def prefix_and_speculation_run(jitter_scale_s: float, legacy: bool, num_requests: int = 60):
    """Each request's prompt hits the prefix cache but for its last token (a one-token prompt
    chunk), then verifies 3 proposals per step and accepts 1 or 2 (2 or 3 tokens a step). `legacy`
    logs the chunks as (n, start) only, as servers did before the chunk kinds were recorded."""
    rng = np.random.default_rng(5)
    steps, records, delays = [], [], []
    for i in range(num_requests):
        prompt, t, produced, events = 30 + i % 15, 1.3 * i, 0, []
        while produced < 20:
            if produced == 0:
                chunk, made = [1, prompt - 1, 1, 0], 1
            else:
                chunk, made = [4, prompt + produced - 1, 2, 3], 2 + int(rng.integers(2))
            steps.append({"index": len(steps), "t_start_s": t, "waited_s": 0.0, "commands_s": 0.0,
                          "step_s": STEP_S, "deliver_s": 0.0,
                          "chunks": [chunk[:2] if legacy else chunk]})  # fmt: skip
            t += STEP_S
            delay = float(rng.exponential(jitter_scale_s))
            produced += made
            delays += [delay] * made
            events.append(StreamEvent(t + delay + OFFSET_S, 3, produced))
        records.append(RequestRecord(f"r{i}", i, "measured", "ok", 0.0, 0.0, 1.0, produced,
                                     events=tuple(events), num_prompt_tokens_server=prompt))  # fmt: skip
    return records, steps, np.asarray(delays)


def test_a_prefix_hit_and_verified_proposals_are_matched_by_the_chunks_kinds():
    """A one-token prompt chunk gives the first token; a verification gives several: the step log's
    chunk kinds match every token. The old (n, start) reading took the first for a decode step and
    the verification for a prompt chunk, so none was matched to its own step."""
    records, steps, delays = prefix_and_speculation_run(2e-3, legacy=False)
    got = delivery_jitter(records, steps)
    assert got is not None and got["num_tokens"] == len(delays)
    q = np.asarray(got["quantiles"])
    expected = np.percentile(delays, [10, 90]) - np.median(delays)
    assert q[[10, 90]] == pytest.approx(expected, abs=2e-4)
    legacy = delivery_jitter(*prefix_and_speculation_run(2e-3, legacy=True)[:2])
    # the old reading matches tokens to other requests' steps, seconds away
    assert legacy is None or abs(legacy["quantiles"][10] - expected[0]) > 0.1


def intake_run(intake_scale_s: float, num_requests: int = 60):
    """One request at a time: it reaches the server `intake` after the client sent it (exponential,
    the spread to recover), a prompt step and 9 decode steps; each token arrives 1-3 ms after its
    step. The records carry the server's TTFT, as `kvserve bench serve` records it."""
    rng = np.random.default_rng(11)
    steps, records, intakes = [], [], []
    for i in range(num_requests):
        prompt, arrive = 40 + i % 7, 0.5 * i
        intake = float(rng.exponential(intake_scale_s))
        intakes.append(intake)
        t, events = arrive, []
        for j in range(10):
            chunk = [prompt, 0, 1, 0] if j == 0 else [1, prompt + j - 1, 2, 0]
            steps.append({"index": len(steps), "t_start_s": t, "waited_s": 0.0, "commands_s": 0.0,
                          "step_s": STEP_S, "deliver_s": 0.0, "chunks": [chunk]})  # fmt: skip
            t += STEP_S
            events.append(StreamEvent(t + float(rng.uniform(1e-3, 3e-3)) + OFFSET_S, 3, j + 1))
        send = arrive - intake + OFFSET_S  # client clock
        records.append(RequestRecord(f"r{i}", i, "measured", "ok", send, send, 1.0, 10,
                                     events=tuple(events), num_prompt_tokens_server=prompt,
                                     extra={"server_metrics": {"ttft_s": STEP_S}}))  # fmt: skip
    return records, steps, np.asarray(intakes)


def test_the_intake_spread_is_recovered_without_the_first_tokens_delivery():
    """Client TTFT - server TTFT is the intake plus the first token's delivery delay: the intake's
    spread (its quantiles less the median) is what remains once the matched delay is taken out."""
    records, steps, intakes = intake_run(20e-3)
    got = delivery_jitter(records, steps)
    assert got["num_requests"] == len(records)
    q = np.asarray(got["intake_quantiles"])
    expected = np.percentile(intakes, [10, 90, 99]) - np.median(intakes)
    assert q[[10, 90, 99]] == pytest.approx(expected, abs=1e-6)
    assert q[50] == pytest.approx(0.0, abs=1e-12)
    no_server = [RequestRecord(**{**r.__dict__, "extra": {}}) for r in records]
    assert "intake_quantiles" not in delivery_jitter(no_server, steps)  # TTFT unknown: no term


def test_the_simulator_draws_each_requests_intake():
    from kvserve.lab.sim.cost import StepProfile
    from kvserve.lab.sim.setup import profile_deployment
    from kvserve.lab.sim.study import EngineShape, Policy, evaluate
    from kvserve.lab.sim.workload import SimRequest

    fit = {"residual_ratio_quantiles": [1.0, 1.0]}
    jitter = {"quantiles": [0.0, 0.0], "lag1_correlation": 0.0}
    spread = {"intake_quantiles": list(np.linspace(-0.004, 0.096, 101))}
    shape = EngineShape(num_blocks=500, max_model_len=512, max_num_seqs=4, chunk_tokens=64)
    requests = tuple(SimRequest(i, 0.5 * i, 10, 5) for i in range(200))
    runs = {}
    for name, extra in (("plain", {}), ("intake", spread), ("again", spread)):
        meta = {"fit": fit, "delivery_jitter": jitter | extra, "request_overhead_s": 0.01}
        cost = profile_deployment(StepProfile(("const",), (0.005,), meta), noise=True).cost_model
        runs[name], _ = evaluate(Policy.parse("on_demand-chunked"), shape, cost, requests, None)
    plain, late = (runs[k]["summary"]["latency_s"]["ttft"] for k in ("plain", "intake"))
    assert plain["p99"] == pytest.approx(plain["p50"])  # alone, constant steps: one TTFT
    assert late["p99"] > plain["p99"] + 0.05  # the intake's tail is in the TTFT tail
    assert late["p50"] == pytest.approx(plain["p50"] + 0.046, abs=0.01)  # spread's median 0.046
    assert runs["again"]["summary"] == runs["intake"]["summary"]  # seeded


def test_no_jitter_measured_gives_a_flat_distribution_and_too_few_tokens_none():
    records, steps, _ = synthetic_run(1e-9)
    q = np.asarray(delivery_jitter(records, steps)["quantiles"])
    assert np.abs(q).max() < 1e-6
    assert delivery_jitter(records[:2], steps) is None


def test_draws_follow_the_quantiles_are_seeded_and_per_request():
    q = list(np.linspace(-1e-3, 9e-3, 101))
    a, b = DeliveryJitter(q, 0.5, seed=3), DeliveryJitter(q, 0.5, seed=3)
    first = a.delays_s(7, 5)
    b.delays_s(1, 100)  # another request's draws do not move request 7's
    assert b.delays_s(7, 5) == first
    many = np.asarray(DeliveryJitter(q, 0.0, seed=1).delays_s(0, 20000))
    assert np.percentile(many, 50) == pytest.approx(4e-3, abs=3e-4)
    assert many.min() >= -1e-3 and many.max() <= 9e-3
    with pytest.raises(ValueError):
        DeliveryJitter([1.0, 0.0])


def test_the_simulator_delivers_tokens_late_and_in_order():
    from kvserve.lab.sim.cost import StepProfile
    from kvserve.lab.sim.setup import profile_deployment
    from kvserve.lab.sim.study import EngineShape, Policy, evaluate
    from kvserve.lab.sim.workload import SimRequest

    fit = {"residual_ratio_quantiles": [1.0, 1.0]}
    jitter = {"quantiles": list(np.linspace(0.0, 0.02, 101)), "lag1_correlation": 0.0}
    shape = EngineShape(num_blocks=500, max_model_len=512, max_num_seqs=4, chunk_tokens=64)
    requests = tuple(SimRequest(i, 0.5 * i, 10, 30) for i in range(4))
    runs = {}
    for name, meta in (
        ("plain", {"fit": fit}),
        ("jitter", {"fit": fit, "delivery_jitter": jitter}),
    ):
        cost = profile_deployment(StepProfile(("const",), (0.005,), meta), noise=True).cost_model
        runs[name], _ = evaluate(Policy.parse("on_demand-chunked"), shape, cost, requests, None)
    plain, late = (runs[k]["summary"]["latency_s"] for k in ("plain", "jitter"))
    # constant steps: every ITL is one step without jitter; with it, the tail widens
    assert plain["itl"]["p99"] == pytest.approx(0.005)
    assert late["itl"]["p99"] > 0.01 and late["ttft"]["p50"] > plain["ttft"]["p50"]
