"""`kvserve bench latency`: the phase split, the identical-output check and the roofline names.

The pure parts (kvserve.lab.bench.phases) are checked on synthetic steps with known answers; one run of
the command on a tiny checkpoint checks the wiring: step counts per phase, chunked prefill, the
engine's own timestamps, the alone-vs-batched comparison (with one injected difference) and the
roofline bound of each regime against docs/planning.md's formulas computed here by hand.
"""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main as cli_main
from kvserve.lab.bench import latency, phases
from kvserve.lab.bench.records import BenchError
from kvserve.lab.plan.hardware import HardwareProfile, save_profile
from kvserve.lab.plan.model import load_model
from tests.checkpoints import build_checkpoint

# --- pure parts ---------------------------------------------------------------------------------------


def _step(duration_s, first=0, decode=0):
    return phases.StepSample(duration_s, first, decode)


def test_split_phases_with_chunked_prefill_and_an_idle_step():
    # 3 requests; prompts chunked over 3 steps; request 0 decodes while the others still prefill
    steps = [
        _step(0.010),
        _step(0.011, first=1),
        _step(0.012, first=2, decode=1),  # mixed: the prefill phase ends here
        _step(0.003, decode=3),
        _step(0.002),  # nothing produced (a preempted request recomputing)
        _step(0.004, decode=3),
    ]
    split = phases.split_phases(steps, num_requests=3)
    assert split.prefill_s == pytest.approx(0.033)
    assert (split.num_prefill_steps, split.num_mixed_steps) == (3, 1)
    assert split.decode_step_s == (0.003, 0.004) and split.decode_step_rows == (3, 3)
    assert (split.num_idle_steps, split.idle_s) == (1, 0.002)
    assert split.decode_s == pytest.approx(0.007)
    # a request that never got a token: no prefill time is claimed
    assert phases.split_phases(steps[:2], num_requests=3).prefill_s is None


def _iteration(prefill_s, decode_steps, wall_s):
    split = phases.PhaseSplit(prefill_s, 1, 0, tuple(decode_steps), 0, 0.0)
    return phases.Iteration(split, wall_s, (prefill_s,) * 2, (), ((1, 2), (3, 4)), 0)


def test_point_summary_keeps_prefill_and_decode_apart():
    iters = [_iteration(0.2, [0.01, 0.03], 0.25), _iteration(0.4, [0.02, 0.02], 0.45)]
    pt = phases.point_summary(batch_size=2, prompt_len=50, output_len=3, iterations=iters)
    assert pt["prefill"]["batch_prefill_s"]["count"] == 2
    assert pt["prefill"]["batch_prefill_s"]["p50"] == pytest.approx(0.3)
    assert pt["prefill"]["prompt_tokens_per_s"] == pytest.approx(100 / 0.3)
    assert pt["prefill"]["ttft_proxy_s"]["count"] == 4
    step = pt["decode"]["step_s"]
    assert (step["count"], step["p50"], step["max"]) == (4, pytest.approx(0.02), 0.03)
    assert pt["decode"]["per_sequence_tokens_per_s"] == pytest.approx(50.0)
    assert pt["decode"]["aggregate_tokens_per_s"] == pytest.approx(100.0)
    wall = pt["wall"]
    assert wall["prefill_s"] == pytest.approx(0.3) and wall["decode_s"] == pytest.approx(0.04)
    assert wall["other_s"] == pytest.approx(0.35 - 0.34)
    assert wall["prefill_share"] == pytest.approx(0.3 / 0.35)
    # no single tokens/s mixes the phases
    assert "tokens_per_s" not in pt and "tokens_per_s" not in wall


def test_the_full_batch_step_counts_only_the_steps_with_every_request_decoding():
    """With chunked prefill the first requests decode while the later prompts fill and finish
    first: the decode phase's later steps carry fewer rows. The planner compares its B-row step
    with the steps that had all B (1207: 48 x 504 tokens, median decode step 59 ms where the
    48-row forward alone took 84)."""
    steps = [
        _step(0.010, first=1),
        _step(0.011, first=1, decode=1),
        _step(0.012, first=1, decode=2),  # the prefill phase ends: 3 requests
        _step(0.030, decode=3),
        _step(0.031, decode=3),
        _step(0.032, decode=3),
        _step(0.005, decode=2),  # request 0 finished
        _step(0.004, decode=1),
        _step(0.004, decode=1),
        _step(0.003, decode=1),
    ]
    split = phases.split_phases(steps, num_requests=3)
    it = phases.Iteration(split, 0.2, (), (), ((1,),) * 3, 0)
    decode = phases.point_summary(3, 10, 4, [it])["decode"]
    assert decode["step_s"]["p50"] == pytest.approx(0.005)  # mostly fewer rows
    assert decode["num_full_batch_steps"] == 3
    assert decode["full_batch_step_s"]["p50"] == pytest.approx(0.031)
    assert decode["batch_step_s"] == pytest.approx(0.031)  # the tokens/s and the roofline's
    assert decode["aggregate_tokens_per_s"] == pytest.approx(3 / 0.031)
    from benchmarks.plan_vs_measured import decode_step_p50

    assert decode_step_p50({"decode": decode}) == pytest.approx(0.031)
    # too few full-batch steps: the p50 of every step
    split = phases.split_phases(steps[:4] + steps[6:], num_requests=3)
    it = phases.Iteration(split, 0.2, (), (), ((1,),) * 3, 0)
    few = phases.point_summary(3, 10, 4, [it])["decode"]
    assert few["num_full_batch_steps"] == 1 and few["batch_step_s"] == few["step_s"]["p50"]
    assert decode_step_p50({"decode": few}) == few["step_s"]["p50"]
    # speculative decoding: rows, not tokens (review): 2 rows with 3 tokens each are not the
    # batch of 3, and 3 rows with 2 tokens each are
    spec = [
        _step(0.010, first=3),
        phases.StepSample(0.02, 0, 6, 2),
        phases.StepSample(0.03, 0, 6, 3),
    ]
    split = phases.split_phases(spec, num_requests=3)
    assert split.decode_step_rows == (2, 3)
    it = phases.Iteration(split, 0.1, (), (), ((1,),) * 3, 0)
    decode = phases.point_summary(3, 10, 4, [it])["decode"]
    assert decode["num_full_batch_steps"] == 1 and decode["full_batch_step_s"]["p50"] == 0.03


def test_first_difference_and_mismatch_report():
    assert phases.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert phases.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert phases.first_difference([1, 2, 3], [1, 2]) == 2
    assert phases.mismatch([4, 5], [4, 5]) is None
    tops = [((4, -0.1), (9, -2.0)), ((5, -0.70), (6, -0.72))]
    m = phases.mismatch([4, 5], [4, 6], tops)
    assert m == {
        "position": 1,
        "reference_token": 5,
        "token": 6,
        "top_two_gap": pytest.approx(0.02),
    }
    assert phases.mismatch([4, 5], [4], tops)["token"] is None


def test_prompts_are_the_same_in_every_batch_and_avoid_eos():
    a = latency.make_prompt(0, 32, 3, 256, frozenset({2}))
    assert a == latency.make_prompt(0, 32, 3, 256, frozenset({2})) and len(a) == 32
    assert a != latency.make_prompt(0, 32, 4, 256, frozenset({2}))
    assert 2 not in latency.make_prompt(0, 4096, 0, 256, frozenset({2}))


def test_bottleneck_notes_a_measurement_far_from_the_roofline():
    def rf(prefill_ratio, decode_ratio):
        return {
            "prefill": {"bound": "compute-bound", "measured_over_roofline": prefill_ratio},
            "decode_step": {"bound": "bandwidth-bound", "measured_over_roofline": decode_ratio},
        }

    assert phases.bottleneck(rf(2.0, 5.0)) == {
        "prefill": "compute-bound",
        "decode": "bandwidth-bound",
    }
    note = phases.bottleneck(rf(0.5, 30.0))["note"]
    assert "decode_step measured over 10x" in note and "prefill measured faster" in note
    assert "note" not in phases.bottleneck(rf(None, None))


def test_resolve_hardware(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    profile, why = phases.resolve_hardware("auto", "cpu")
    assert profile is None and "kvserve plan --measure" in why
    measured = HardwareProfile("this-machine", 1e9, 1e9, 1e10, "fp32", measured=True,
                               source="measured by `kvserve plan --measure`: X (cpu, 2 threads)")  # fmt: skip
    save_profile(measured)
    assert phases.resolve_hardware("auto", "cpu")[0] == measured
    profile, why = phases.resolve_hardware("auto", "cuda:0")  # a CPU profile says nothing of a GPU
    assert profile is None and "is for cpu" in why
    assert phases.resolve_hardware("h100", "cuda")[0].name == "H100 SXM"
    assert phases.resolve_hardware("none", "cpu") == (None, "--hardware none")
    with pytest.raises(BenchError, match="unknown hardware"):
        phases.resolve_hardware("no-such-device", "cpu")


# --- the command, on a tiny checkpoint -----------------------------------------------------------------

L, D, N_KV, D_H, F, V = 2, 64, 2, 16, 128, 256  # tests/checkpoints.py's llama


def _hand_roofline(batch: int, prompt: int, output: int, bw: float, peak: float):
    """docs/planning.md by hand for the fp32 tiny Llama (untied head)."""
    per_block = 2 * D * D + 2 * D * N_KV * D_H + 3 * D * F + 2 * D
    n_matmul = L * per_block + D + V * D  # N minus the untied input embedding
    weight_bytes = 4 * (L * per_block + D + 2 * V * D)
    k = 2 * L * N_KV * D_H * 4
    p_flops = batch * (2 * n_matmul * prompt + 2 * L * D * prompt**2)
    p_bytes = weight_bytes + k * batch * prompt
    t = prompt + output / 2
    d_flops = batch * (2 * n_matmul + 4 * L * D * t)
    d_bytes = weight_bytes + batch * k * t

    def bound(flops, num_bytes):
        return "compute-bound" if flops / peak > num_bytes / bw else "bandwidth-bound"

    return (p_flops, p_bytes, bound(p_flops, p_bytes)), (d_flops, d_bytes, bound(d_flops, d_bytes))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("latency-llama")
    build_checkpoint(path, "llama")
    return path


@pytest.mark.slow
def test_latency_grid_end_to_end(tiny_dir, tmp_path, monkeypatch, capsys):
    # a measured-profile file: ridge 10 FLOP/B puts the two prefill sizes on either side of it
    bw, peak = 1e9, 1e10
    profile = HardwareProfile("test-device", 8e9, bw, peak, "fp32", measured=True, source="test")
    profile_path = save_profile(profile, tmp_path / "profile.json")
    # inject one difference: prompt 1 of every batch of 3 loses its third token
    real = latency.run_iteration

    def perturbed(llm, prompts, params, sync):
        it = real(llm, prompts, params, sync)
        if len(prompts) != 3:
            return it
        outs = [list(o) for o in it.output_token_ids]
        outs[1][2] = (outs[1][2] + 1) % V
        return phases.Iteration(it.split, it.wall_s, it.ttft_proxy_s, it.itl_engine_s,
                                tuple(map(tuple, outs)), it.num_preemptions)  # fmt: skip

    monkeypatch.setattr(latency, "run_iteration", perturbed)
    out = tmp_path / "out"
    rc = cli_main(["bench", "latency", "--model", str(tiny_dir), "--batch-sizes", "1,3",
                   "--prompt-lens", "20", "--output-lens", "4", "--iters", "2",
                   "--warmup-iters", "1", "--max-num-batched-tokens", "16",
                   "--hardware", str(profile_path), "--out", str(out), "--require-identical"])  # fmt: skip
    assert rc == 1  # --require-identical: the injected difference fails the run
    printed = capsys.readouterr().out
    assert "MISMATCH B=3 P=20 O=4 prompt 1: first differs at position 2" in printed
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "latency.json").read_text())
    assert doc["schema"] == "kvserve.lab.bench.latency/1"
    # the engine default (prefix caching on); every iteration resets the cache (docs/load-tests.md)
    assert doc["engine"]["options"]["enable_prefix_caching"] is True
    assert [(p["batch_size"], p["prompt_len"], p["output_len"]) for p in doc["points"]] == [
        (1, 20, 4),
        (3, 20, 4),
    ]
    for pt in doc["points"]:
        b = pt["batch_size"]
        # every timed iteration: one prefill time; O - 1 decode steps after it
        assert pt["prefill"]["batch_prefill_s"]["count"] == 2
        assert pt["decode"]["num_steps_per_iteration"] == [3, 3]
        assert pt["decode"]["step_s"]["count"] == 6
        assert pt["decode"]["itl_engine_s"]["count"] == 2 * b * 3
        assert pt["prefill"]["ttft_proxy_s"]["count"] == 2 * b
        assert pt["num_preemptions"] == 0
        # 16 tokens per step: B x 20 prompt tokens need at least ceil(20 B / 16) steps
        assert min(pt["prefill"]["num_steps"]) >= -(-20 * b // 16)
        assert pt["wall"]["prefill_s"] > 0 and pt["wall"]["decode_s"] > 0
        # roofline names and numbers from docs/planning.md, by hand
        (pf, pb, p_bound), (df, db, d_bound) = _hand_roofline(b, 20, 4, bw, peak)
        rf = pt["roofline"]
        assert (rf["prefill"]["flops"], rf["prefill"]["bytes"]) == (pf, pb)
        assert (rf["decode_step"]["flops"], rf["decode_step"]["bytes"]) == (df, db)
        assert pt["bottleneck"]["prefill"] == p_bound and pt["bottleneck"]["decode"] == d_bound
        assert rf["prefill"]["measured_s"] == pt["prefill"]["batch_prefill_s"]["p50"]
    assert [p["bottleneck"]["prefill"] for p in doc["points"]] == [
        "bandwidth-bound",  # 1 x 20 tokens: ~8.5 FLOP/B, below the ridge
        "compute-bound",  # 3 x 20 tokens: ~24 FLOP/B
    ]
    assert doc["points"][1]["prefill"]["num_mixed_steps"][0] >= 1  # chunked: some decode inside
    ident = doc["identical_outputs"]
    # prompts 0 (B=1) and 0, 1, 2 (B=3) against themselves alone: only the injected one differs
    assert ident["num_compared"] == 4 and ident["num_repeat_mismatches"] == 0
    (m,) = ident["mismatches"]
    assert (m["batch_size"], m["prompt_index"], m["position"]) == (3, 1, 2)
    assert m["token"] == (m["reference_token"] + 1) % V
    assert m["top_two_gap"] >= 0
    assert doc["points"][0]["identical"] == {"num_compared_alone": 1, "num_mismatches": 0}


@pytest.mark.slow
def test_latency_without_a_profile_says_unknown(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "empty"))
    rc = cli_main(["bench", "latency", "--model", str(tiny_dir), "--batch-sizes", "2",
                   "--prompt-lens", "5", "--output-lens", "1", "--iters", "1",
                   "--warmup-iters", "0", "--no-plot", "--out", str(tmp_path / "out"),
                   "--kv-cache-dtype", "int8"])  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "latency.json").read_text())
    # regression: the metadata reported the compute dtype as the KV cache's, and no quantisation
    assert doc["engine"]["kv_cache_dtype"] == "int8" and doc["engine"]["quantization"] is None
    assert doc["engine"]["options"]["kv_cache_dtype"] == "int8"
    (pt,) = doc["points"]
    assert pt["bottleneck"]["prefill"] == pt["bottleneck"]["decode"] == "unknown"
    assert "kvserve plan --measure" in pt["bottleneck"]["why"] and pt["roofline"] is None
    # one output token: no decode step, so no decode speed (never a division by zero)
    assert pt["decode"]["step_s"]["count"] == 0 and pt["decode"]["aggregate_tokens_per_s"] is None
    assert doc["identical_outputs"]["all_identical"]
    assert not (tmp_path / "out" / "latency.png").exists()
    assert "roofline: unknown" in capsys.readouterr().out


def test_latency_rejects_a_grid_that_does_not_fit(tiny_dir, tmp_path, capsys):
    rc = cli_main(["bench", "latency", "--model", str(tiny_dir), "--batch-sizes", "4",
                   "--prompt-lens", "500", "--output-lens", "100", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 2 and "exceeds the context of 512 tokens" in capsys.readouterr().err
    rc = cli_main(["bench", "latency", "--model", str(tiny_dir), "--batch-sizes", "64",
                   "--prompt-lens", "400", "--output-lens", "8", "--kv-cache-memory", "1MiB",
                   "--out", str(tmp_path)])  # fmt: skip
    assert rc == 2 and "raise --kv-cache-memory" in capsys.readouterr().err


def test_latency_refuses_a_batch_larger_than_max_num_seqs(tiny_dir, tmp_path, capsys):
    rc = cli_main(["bench", "latency", "--model", str(tiny_dir), "--batch-sizes", "1,8",
                   "--max-num-seqs", "4", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 2 and "exceeds --max-num-seqs 4" in capsys.readouterr().err


def test_plan_reads_the_tiny_model_as_the_hand_formulas_do(tiny_dir):
    spec = load_model(str(tiny_dir))
    shape = (spec.num_layers, spec.hidden_size, spec.num_kv_heads, spec.head_dim)
    assert shape == (L, D, N_KV, D_H)
    assert (spec.intermediate_size, spec.vocab_size, spec.tie_word_embeddings) == (F, V, False)


def test_latency_runs_a_quantised_engine(tiny_dir, tmp_path, monkeypatch):
    # benchmarks/plan_vs_measured.py times int8 / int4 steps through this flag (it was missing)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "empty"))
    rc = cli_main(["bench", "latency", "--model", str(tiny_dir), "--batch-sizes", "2",
                   "--prompt-lens", "5", "--output-lens", "3", "--iters", "1",
                   "--warmup-iters", "0", "--no-plot", "--quantization", "int8",
                   "--out", str(tmp_path / "out")])  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "latency.json").read_text())
    assert doc["engine"]["quantization"] == "int8"
    assert doc["points"][0]["decode"]["step_s"]["count"] == 2
