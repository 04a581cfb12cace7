"""Calibration quality: a fit's error is reported, a poor fit is refused (or saved only when
accepted, marked poor and warned about), step noise from the residuals, and rejection reasons."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.lab.sim.cost import DEFAULT_FEATURES, ChunkLoad, StepLoad, StepProfile, feature_vector
from kvserve.lab.sim.fit import FitBound, PoorFitError, fit_profile, judge_fit
from kvserve.lab.sim.noise import NoisyCost
from kvserve.lab.sim.study import EngineShape, Policy, evaluate
from kvserve.lab.sim.workload import SimRequest

TRUTH = (2e-3, 5e-6, 1e-4, 3e-8, 1e-9)


def synthetic_steps(noise_sigma: float, num: int = 400, seed: int = 0):
    """Steps of a known linear cost, times lognormal noise of `noise_sigma` (log-space std)."""
    rng = np.random.default_rng(seed)
    loads, times = [], []
    for _ in range(num):
        chunks = [ChunkLoad(1, int(rng.integers(0, 2000))) for _ in range(int(rng.integers(1, 30)))]
        if rng.random() < 0.3:
            chunks.append(ChunkLoad(int(rng.integers(2, 500)), int(rng.integers(0, 500))))
        load = StepLoad(tuple(chunks))
        base = float(np.dot(TRUTH, feature_vector(load, DEFAULT_FEATURES)))
        loads.append(load)
        times.append(base * float(rng.lognormal(0.0, noise_sigma)))
    return loads, times


def test_a_quiet_machine_fits_within_the_bound():
    loads, times = synthetic_steps(noise_sigma=0.05)
    profile = fit_profile(loads, times)
    assert judge_fit(profile, FitBound(), accept_poor=False) == []
    fit = profile.meta["fit"]
    assert fit["median_abs_rel_error"] < 0.06 and fit["poor"] is False
    assert profile.coef_s[:3] == pytest.approx(TRUTH[:3], rel=0.1)  # the large terms


def test_a_fit_to_deliberately_noisy_timings_is_refused():
    # A busy machine: each step 0.1x .. 10x its cost. The fit's median error is far over 30%.
    loads, times = synthetic_steps(noise_sigma=1.2)
    profile = fit_profile(loads, times)
    fit = profile.meta["fit"]
    assert fit["median_abs_rel_error"] > 0.3
    with pytest.raises(PoorFitError, match="median .* > bound 30%"):
        judge_fit(profile, FitBound(), accept_poor=False)


def test_an_accepted_poor_fit_is_marked_poor_in_the_saved_profile(tmp_path):
    loads, times = synthetic_steps(noise_sigma=1.2)
    profile = fit_profile(loads, times)
    bad = judge_fit(profile, FitBound(), accept_poor=True)
    assert bad and "median" in bad[0]
    again = StepProfile.load(profile.save(tmp_path / "p.json"))
    assert again.meta["fit"]["poor"] is True and again.meta["fit"]["violations"] == bad


def test_residual_quantiles_are_the_measured_over_predicted_ratios():
    loads, times = synthetic_steps(noise_sigma=0.3, num=2000)
    profile = fit_profile(loads, times)
    q = profile.meta["fit"]["residual_ratio_quantiles"]
    predicted = np.array([profile.load_s(s) for s in loads])
    ratio = np.array(times) / predicted
    assert len(q) == 101 and q == sorted(q)
    assert q[50] == pytest.approx(float(np.median(ratio)))
    assert q[99] == pytest.approx(float(np.percentile(ratio, 99)))
    # lognormal(0, 0.3): the 99th percentile of the noise is exp(2.326 * 0.3) ~ 2.01 relative to
    # its median, which the ratios must show (the fit's scale cancels in the quotient).
    assert q[99] / q[50] == pytest.approx(np.exp(2.326 * 0.3), rel=0.1)


def test_noisy_cost_keeps_the_mean_and_draws_the_same_sequence_after_reset():
    base = StepProfile(("const",), (0.01,))
    rng = np.random.default_rng(3)
    ratios = np.sort(rng.lognormal(0, 0.4, 5000))
    ratios = ratios / ratios.mean()
    quantiles = tuple(np.percentile(ratios, np.linspace(0, 100, 101)))
    noisy = NoisyCost(base, quantiles, seed=5)
    draws = np.array([noisy.draw() for _ in range(20000)])
    assert draws.mean() == pytest.approx(noisy.mean_ratio, rel=0.02)
    assert noisy.mean_ratio == pytest.approx(1.0, rel=0.03)
    assert np.percentile(draws, 99) == pytest.approx(np.percentile(ratios, 99), rel=0.05)
    noisy.reset()
    first = [noisy.draw() for _ in range(5)]
    noisy.reset()
    assert [noisy.draw() for _ in range(5)] == first


def test_step_noise_widens_simulated_itl_tails_but_not_the_mean():
    profile = StepProfile(("const", "num_seqs"), (0.01, 0.001))
    quantiles = tuple(np.percentile(np.random.default_rng(0).lognormal(0, 0.5, 4000), range(101)))
    quantiles = tuple(q / np.mean(quantiles) for q in quantiles)
    shape = EngineShape(num_blocks=2000, max_model_len=1024, max_num_seqs=8, chunk_tokens=256)
    requests = tuple(SimRequest(i, 0.05 * i, 50, 40) for i in range(40))
    policy = Policy.parse("on_demand-chunked")
    plain, _ = evaluate(policy, shape, profile, requests, None)
    noisy_cost = NoisyCost(profile, quantiles, seed=1)
    noisy, _ = evaluate(policy, shape, noisy_cost, requests, None)
    again, _ = evaluate(policy, shape, noisy_cost, requests, None)
    p, n = plain["summary"]["latency_s"]["itl"], noisy["summary"]["latency_s"]["itl"]
    assert n["p99"] > 1.5 * p["p99"]
    assert n["mean"] == pytest.approx(p["mean"], rel=0.1)
    assert again["summary"]["latency_s"] == noisy["summary"]["latency_s"]  # seeded, reset per run


def test_simulate_names_why_requests_were_rejected(tmp_path, capsys):
    from kvserve.cli import main

    args = ["simulate", "SmolLM2-135M", "--hardware", "l4", "--num-requests", "6"]
    args += ["--input-len", "uniform:100:900", "--output-len", "200", "--max-model-len", "800"]
    assert main(args + ["--policy", "on_demand", "--output", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "o.json").read_text())
    rejections = doc["runs"][0]["sim"]["rejections"]
    num = doc["runs"][0]["sim"]["num_rejected"]
    assert num > 0 and rejections["longer_than_context"]["count"] == num
    assert f"rejected {num} request(s) (on_demand at 1 req/s): longer than context" in out
    assert "exceeds the context of 800 tokens" in out


def test_calibration_cli_refuses_a_poor_fit_and_saves_one_only_when_accepted(
    tmp_path, capsys, tiny_dir
):
    from kvserve.cli import main

    save = tmp_path / "profile.json"
    args = ["simulate", "--calibrate", str(tiny_dir), "--save", str(save), "--dtype", "float32"]
    args += ["--calibrate-max-len", "40", "--calibrate-budget-s", "1", "--max-num-seqs", "4"]
    args += ["--chunk-tokens", "24", "--max-model-len", "128", "--num-blocks", "40"]
    # A real engine's steps never fit within 0.01% (the bound stands in for a noisy machine).
    assert main(args + ["--max-fit-error", "1e-4"]) == 2
    err = capsys.readouterr().err
    assert "the step-cost fit is poor" in err and "--accept-poor-fit" in err
    assert not save.exists()
    assert main(args + ["--max-fit-error", "1e-4", "--accept-poor-fit"]) == 0
    assert "WARNING: POOR FIT" in capsys.readouterr().err
    fit = json.loads(save.read_text())["fit"]
    assert fit["poor"] is True and fit["bound"]["max_median_abs_rel_error"] == 1e-4


def test_calibration_times_the_quantised_engine_it_is_given(tmp_path, capsys, tiny_dir):
    """`--quantization` reaches the calibrated engine (the profile records the engine config's
    format); without --calibrate it is refused, not ignored."""
    from kvserve.cli import main

    save = tmp_path / "profile.json"
    args = ["simulate", "--calibrate", str(tiny_dir), "--save", str(save), "--dtype", "float32"]
    args += ["--calibrate-max-len", "40", "--calibrate-budget-s", "1", "--max-num-seqs", "4"]
    args += ["--chunk-tokens", "24", "--max-model-len", "128", "--num-blocks", "40"]
    args += ["--accept-poor-fit", "--quantization", "linear=bf16,head=bf16"]
    assert main(args) == 0
    capsys.readouterr()
    doc = json.loads(save.read_text())
    assert doc["engine"]["quantization"] == "linear=bf16,head=bf16"
    roofline = ["simulate", "kvserve-demo", "--quantization", "int8", "--request-rate", "1"]
    assert main(roofline) == 2
    assert "--weights" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.checkpoints import build_checkpoint

    path = tmp_path_factory.mktemp("calib") / "llama"
    build_checkpoint(path, "llama")
    return path


def test_speculative_decoding_commits_the_independence_models_tokens_per_verify():
    from kvserve.lab.sim.speculative import SpecModel

    spec = SpecModel(num_speculative_tokens=4, acceptance=0.6)
    profile = StepProfile(("const", "num_tokens"), (0.01, 1e-4))
    base = EngineShape(num_blocks=4000, max_model_len=2048, max_num_seqs=8, chunk_tokens=512)
    requests = tuple(SimRequest(i, 0.2 * i, 30, 400) for i in range(6))
    policy = Policy.parse("on_demand-chunked")
    plain, plain_run = evaluate(policy, base, profile, requests, None)
    shape = EngineShape(**(base.__dict__ | {"speculative": spec, "seed": 3}))
    fast, run = evaluate(policy, shape, profile, requests, None)
    assert all(len(t.token_times_s) == 400 for t in run.timelines)  # lengths stay exact
    # each verification step commits (1 - a^(k+1)) / (1 - a) = 2.3056 tokens on average
    per_step = [400 / len(set(t.token_times_s)) for t in run.timelines]
    assert np.mean(per_step) == pytest.approx(spec.expected_tokens_per_verify, rel=0.05)
    assert plain_run.num_steps > 1.5 * run.num_steps
    tpot = lambda r: r["summary"]["latency_s"]["tpot"]["p50"]  # noqa: E731
    assert tpot(fast) < 0.6 * tpot(plain)
    # a draft as slow as the target step loses the gain
    slow = SpecModel(4, 0.6, draft_step_s=0.01)
    shape = EngineShape(**(base.__dict__ | {"speculative": slow, "seed": 3}))
    slowed, _ = evaluate(policy, shape, profile, requests, None)
    assert tpot(slowed) > tpot(plain)


def test_cli_speculative_flags_reach_the_engine_shape(capsys):
    from kvserve.cli import main

    args = ["simulate", "SmolLM2-135M", "--hardware", "l4", "--num-requests", "4"]
    args += ["--input-len", "100", "--output-len", "50", "--policy", "on_demand", "--json"]
    assert main(args + ["--speculative-k", "3", "--acceptance", "0.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine"]["speculative"]["num_speculative_tokens"] == 3
    assert doc["engine"]["speculative"]["expected_tokens_per_verify"] == pytest.approx(1.875)
    assert main(args + ["--speculative-k", "3", "--acceptance", "1.5"]) == 2
    assert "acceptance must be in [0, 1)" in capsys.readouterr().err


def test_residuals_are_kept_per_step_class_and_each_step_draws_from_its_own():
    # decode steps scatter by 5%, prompt steps by 50%: one pooled distribution would give a
    # decode step the prompt steps' tail (the light-load ITL p99 error of docs/simulator.md)
    rng = np.random.default_rng(0)
    loads, times = [], []
    for i in range(1200):
        if i % 4 == 0:
            load, sigma = StepLoad((ChunkLoad(200, 0), ChunkLoad(1, 100))), 0.5
        else:
            load, sigma = StepLoad((ChunkLoad(1, int(rng.integers(10, 500))),)), 0.05
        loads.append(load)
        base = float(np.dot(TRUTH, feature_vector(load, DEFAULT_FEATURES)))
        times.append(base * float(rng.lognormal(0.0, sigma)))
    profile = fit_profile(loads, times)
    by_class = profile.meta["fit"]["residual_ratio_quantiles_by_class"]
    assert set(by_class) == {"decode-1", "prefill"}
    decode, prefill = (np.array(by_class[c]["quantiles"]) for c in ("decode-1", "prefill"))
    assert decode[99] / decode[50] == pytest.approx(np.exp(2.326 * 0.05), rel=0.05)
    assert prefill[99] / prefill[50] > 2.5
    noisy = NoisyCost(profile, profile.meta["fit"]["residual_ratio_quantiles"], 0,
                      {k: tuple(v["quantiles"]) for k, v in by_class.items()})  # fmt: skip
    draws = [noisy.draw(StepLoad((ChunkLoad(1, 50),))) for _ in range(4000)]
    assert np.percentile(draws, 99) / np.median(draws) < 1.2
    # a decode bucket that was never measured draws from the nearest one
    assert noisy.quantiles_for(StepLoad((ChunkLoad(1, 5),) * 9)) is noisy._by_class["decode-1"]


def test_lag1_correlation_is_measured_and_reproduced_with_the_measured_marginals():
    rng = np.random.default_rng(1)
    z, zs = 0.0, []
    for _ in range(3000):
        z = 0.7 * z + np.sqrt(1 - 0.49) * rng.standard_normal()
        zs.append(z)
    loads = [StepLoad((ChunkLoad(1, int(rng.integers(10, 500))),)) for _ in zs]
    base = [float(np.dot(TRUTH, feature_vector(s, DEFAULT_FEATURES))) for s in loads]
    times = [b * float(np.exp(0.2 * zz)) for b, zz in zip(base, zs, strict=True)]
    fit = fit_profile(loads, times).meta["fit"]
    assert fit["residual_lag1_correlation"] == pytest.approx(0.7, abs=0.05)
    q = tuple(fit["residual_ratio_quantiles"])
    noisy = NoisyCost(StepProfile(("const",), (0.01,)), q, 3, {}, 0.7)
    draws = np.array([noisy.draw() for _ in range(20000)])
    assert np.corrcoef(np.log(draws[:-1]), np.log(draws[1:]))[0, 1] == pytest.approx(0.7, abs=0.05)
    assert np.percentile(draws, 99) == pytest.approx(np.interp(0.99, np.linspace(0, 1, 101), q),
                                                     rel=0.05)  # fmt: skip
    independent = NoisyCost(StepProfile(("const",), (0.01,)), q, 3)
    d0 = np.array([independent.draw() for _ in range(5000)])
    assert abs(np.corrcoef(d0[:-1], d0[1:])[0, 1]) < 0.05
