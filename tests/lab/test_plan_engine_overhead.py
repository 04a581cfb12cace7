"""The engine outside the forward and the fused step's two paths in the planner's decode step
(kvserve.lab.plan.engine_cost, kvserve/lab/measure_overhead.py, docs/planning.md): a synthetic profile
gives the expected sum and the term is in `kvserve plan`'s output; the pooled step vs the forking
path by rows x context; the real engine's parts add up and land where the time is spent."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvserve.lab.plan import arith, make_plan, parse_weight_format
from kvserve.lab.plan.engine_cost import EngineCost
from kvserve.lab.plan.hardware import HardwareProfile, save_profile
from tests.lab.test_plan_fused_profile import FP32, FUSED, PER_OP, SPEC, pt

ENGINE = (
    pt("engine-sample", 1, median_s=3e-4),
    pt("engine-sample", 16, median_s=7e-4),
    pt("engine-runner", 1, median_s=1e-4),
    pt("engine-runner", 16, median_s=2e-4),
    pt("engine-loop", 1, median_s=2e-4),
    pt("engine-loop", 16, median_s=6e-4),
)
FORK = (
    pt("fork-dispatch", 1, median_s=2e-4),
    pt("fork-dispatch", 4, median_s=3e-4),
    pt("fork-fixed", 1, median_s=5e-4),
    pt("fork-fixed", 4, median_s=6e-4),
)


def hw(points, pooled_values: int = 0) -> HardwareProfile:
    return HardwareProfile(
        "m", 1e12, 1e9, 1e15, "fp32", measured=True, points=points, decode_fused_rows=4,
        decode_pooled_values=pooled_values,
    )  # fmt: skip


def test_the_engine_term_is_the_sum_of_its_measured_parts():
    with_engine = EngineCost.from_profile(SPEC, FP32, 0.0, hw(PER_OP + FUSED + ENGINE))
    without = EngineCost.from_profile(SPEC, FP32, 0.0, hw(PER_OP + FUSED))
    assert with_engine.terms_s(1, 0)["engine"] == pytest.approx(3e-4 + 1e-4 + 2e-4)
    assert with_engine.terms_s(16, 0)["engine"] == pytest.approx(7e-4 + 2e-4 + 6e-4)
    # log2 rows between the measured 1 and 16: 4 rows is half way
    assert with_engine.terms_s(4, 0)["engine"] == pytest.approx((6e-4 + 15e-4) / 2)
    for batch in (1, 4, 16):
        assert with_engine.decode_step_s(batch, 0) == pytest.approx(
            without.decode_step_s(batch, 0) + with_engine.terms_s(batch, 0)["engine"]
        )
    assert without.terms_s(1, 0)["engine"] == 0.0
    assert "not measured" in without.sources()["engine"]
    assert "the sampler" in with_engine.sources()["engine"]


def test_the_bound_is_engine_when_the_engine_outside_the_forward_is_the_largest_part():
    big = tuple(pt(p.kind, p.num_columns, median_s=p.median_s * 100) for p in ENGINE)
    cost = EngineCost.from_profile(SPEC, FP32, 0.0, hw(PER_OP + FUSED + big))
    assert cost.decode_bound(1, 0) == "engine"


def test_the_term_is_in_the_plan_and_in_kvserve_plans_output(tmp_path, capsys):
    from tests.lab.test_plan_cli import run_plan

    profile = hw(PER_OP + FUSED + ENGINE)
    plan = make_plan(SPEC, profile, "fp32", "fp32")
    t = plan.workload.mean_decode_context
    cost = EngineCost.from_profile(SPEC, FP32, arith.kv_bytes_per_token(SPEC, 4), profile)
    assert plan.latency.tpot_solo_s == pytest.approx(cost.decode_step_s(1, t))
    note = next(n for n in plan.notes if n.startswith("decode step at B=1"))
    assert "engine outside the forward 0.60 ms" in note
    assert "the sampler 0.30 ms" in note and "the runner's inputs and outputs 0.10 ms" in note
    path = save_profile(profile, tmp_path / "m.json")
    rc, out, _ = run_plan(["SmolLM2-135M", "--hardware", str(path), "--weights", "fp32"], capsys)
    assert rc == 0
    assert "engine outside the forward" in out and "the scheduler" in out


def test_the_fused_step_runs_pooled_at_short_contexts_and_forks_above():
    # SPEC: 2 KV heads x head_dim 16 = 32 cached values per token; the pooled step below 4096
    cost = EngineCost.from_profile(SPEC, FP32, 0.0, hw(PER_OP + FUSED + FORK, pooled_values=4096))
    assert cost.path(1, 100) == "pooled" and cost.path(4, 30) == "pooled"
    assert cost.path(4, 100) == "fork" and cost.path(1, 200) == "fork"
    assert cost.path(16, 10) == "per-op"
    assert cost.terms_s(1, 100)["dispatch"] == pytest.approx(3 * 2e-5 + 1e-4)
    assert cost.terms_s(1, 200)["dispatch"] == pytest.approx(3 * 2e-4 + 5e-4)
    assert cost.terms_s(4, 100)["dispatch"] == pytest.approx(3 * 3e-4 + 6e-4)
    assert "as one region below 4096" in cost.sources()["dispatch"]
    # a profile from before the pooled step told apart: one fused path, priced as measured
    old = EngineCost.from_profile(SPEC, FP32, 0.0, hw(PER_OP + FUSED))
    assert old.path(1, 200) == "fused"
    assert old.terms_s(1, 200)["dispatch"] == pytest.approx(3 * 2e-5 + 1e-4)


def test_the_engines_parts_add_up_to_the_step_less_the_forward():
    from kvserve.lab.measure_overhead import overhead_points, split_step

    steps = [split_step(0.030, 0.025, 0.020, 0.003), split_step(0.040, 0.032, 0.024, 0.004)]
    for s, (step_s, forward_s) in zip(steps, [(0.030, 0.020), (0.040, 0.024)], strict=True):
        assert sum(s.values()) == pytest.approx(step_s - forward_s)
    points = {p.kind: p.median_s for p in overhead_points({4: steps})}
    assert points == pytest.approx(
        {"engine-sample": 0.0035, "engine-runner": 0.003, "engine-loop": 0.0065}
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from tests.checkpoints import build_gpt2_tokenized_checkpoint

    path = tmp_path_factory.mktemp("tiny")
    build_gpt2_tokenized_checkpoint(path)
    return str(path)


def test_measure_overhead_times_the_real_engine_and_puts_a_slow_sampler_in_its_part(
    tiny_checkpoint, monkeypatch
):
    import kvserve.runner.model_runner as runner_mod
    from kvserve.lab.measure_overhead import PARTS, measure_overhead

    forward, sample = runner_mod.forward_chunks, runner_mod.ModelRunner._sample
    points = measure_overhead(tiny_checkpoint, rows=(1, 2), new_tokens=4, iters=1)
    assert sorted((p.kind, p.num_columns) for p in points) == sorted(
        (k, n) for k in PARTS for n in (1, 2)
    )
    assert all(p.median_s >= 0 for p in points)
    # the timers are gone afterwards
    assert runner_mod.forward_chunks is forward and runner_mod.ModelRunner._sample is sample

    # An injected delay of 1,000 s in the sampler, on a clock of our own (no sleep): it lands in
    # engine-sample only (the real parts take milliseconds).
    import types

    import kvserve.lab.measure_overhead as overhead_mod

    delay_s = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + delay_s[0])

    def slow_sample(self, *args, **kwargs):
        delay_s[0] += 1000.0
        return sample(self, *args, **kwargs)

    monkeypatch.setattr(overhead_mod, "time", clock)
    monkeypatch.setattr(runner_mod.ModelRunner, "_sample", slow_sample)
    slow = {p.kind: p.median_s for p in measure_overhead(tiny_checkpoint, rows=(1,), new_tokens=3,
                                                        iters=1)}  # fmt: skip
    assert slow["engine-sample"] >= 1000.0
    assert slow["engine-runner"] < 1000.0 and slow["engine-loop"] < 1000.0


@pytest.mark.parametrize("threads", [2, 1])
def test_the_planners_path_rule_matches_the_kernels_choice(threads):
    """The profile fields `kvserve plan --measure` writes (measure_engine.fused_profile_fields)
    and EngineCost.path give the step shape the kernel takes, read from its own counters: the
    fused step or not (the decoder's step count), pooled (one OpenMP region) or not (pooled_steps())."""
    import torch

    from kvserve.lab.measure_engine import fused_profile_fields, fused_rows, tiny_decoder
    from kvserve.model import fused_decode

    if not fused_rows():
        pytest.skip("no fused step here")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        measured = [pt("fused-dispatch", n, median_s=1e-5) for n in (1, fused_rows())]
        measured += [pt("fused-fixed", n, median_s=1e-4) for n in (1, fused_rows())]
        profile = replace(hw(PER_OP + tuple(measured)), **fused_profile_fields(measured, threads))
        cost = EngineCost.from_profile(SPEC, FP32, 0.0, profile)
        # short contexts, beyond 256 positions per split (the flash-decoding merge), and long;
        # the fp32 step's most rows and one more
        shapes = [(1, 40), (1, 700), (1, 2100), (4, 300), (fused_rows(), 40),
                  (fused_rows(), 600), (fused_rows() + 1, 40)]  # fmt: skip
        for rows, context in shapes:
            make_step, model = tiny_decoder(1, True, context=context, max_batch=rows)
            pooled_before = fused_decode.pooled_steps()
            with torch.inference_mode():
                make_step(rows)()
            ran_fused = model.fused is not None and model.fused.num_steps == 1
            ran_pooled = fused_decode.pooled_steps() > pooled_before
            kernel = "pooled" if ran_pooled else "fused" if ran_fused else "per-op"
            assert cost.path(rows, context) == kernel, (rows, context, threads)
        assert cost.path(fused_rows(), 40) == ("pooled" if threads > 1 else "fused")
    finally:
        torch.set_num_threads(saved)


def test_the_fused_rows_are_the_fixed_points_rows_not_the_pooled_host_points():
    """With --measure-model the per-layer fused points are the pooled step's host points, at 1, 4 and 16 rows;
    the fixed part is timed at every row count the step takes (up to 64). The profile said 16,
    and the planner priced steps of 17-64 rows per-op although the engine ran them fused."""
    from kvserve.lab.measure_engine import FUSED_ROWS, fused_profile_fields

    measured = [pt("fused-dispatch", n, median_s=1e-5) for n in (1, 4, 16)]
    measured += [pt("fused-fixed", n, median_s=1e-4) for n in FUSED_ROWS]
    fields = fused_profile_fields(measured, 2)
    assert fields["decode_fused_f32_rows"] == max(FUSED_ROWS) == 64
    only_dispatch = fused_profile_fields(measured[:3], 2)  # an older measurement's points
    assert only_dispatch["decode_fused_f32_rows"] == 16


def test_quantised_steps_are_fused_up_to_sixteen_rows_as_fp32_ones_are():
    """decode_step_max_rows: the quantised GEMV takes any rows, so a quantised step runs fused up to
    the same 16 rows as an fp32 one (it was 4 before; `decode_fused_rows` keeps the GEMV tile)."""
    profile = replace(
        hw(PER_OP + FUSED), decode_fused_rows=4, decode_fused_f32_rows=16,
        decode_pooled_any_context=True,
    )  # fmt: skip
    fp32 = EngineCost.from_profile(SPEC, FP32, 0.0, profile)
    int8 = EngineCost.from_profile(SPEC, parse_weight_format("int8"), 0.0, profile)
    assert fp32.path(16, 5000) == "pooled" and fp32.path(17, 10) == "per-op"
    assert int8.path(16, 5000) == "pooled" and int8.path(17, 10) == "per-op"
    assert "as one region at every context" in fp32.sources()["dispatch"]
    # not for every cache (the planner passes fused_eligible=False for a bf16 / fp16 one)
    no_kv = EngineCost.from_profile(SPEC, FP32, 0.0, profile, fused_eligible=False)
    assert no_kv.path(1, 10) == "per-op"


def test_fused_fp32_steps_above_four_rows_stream_at_the_panel_gemvs_rate():
    rates = (
        pt("linear:fp32", 1, 10e9), pt("linear:fp32", 4, 8e9), pt("linear:fp32", 8, 40e9),
        pt("linear:fp32", 16, 60e9),  # oneDNN, the per-op path above 4 rows
        pt("linear-fused:fp32", 8, 6e9), pt("linear-fused:fp32", 16, 5e9),
    )  # fmt: skip
    profile = replace(
        hw(PER_OP + FUSED + rates), decode_fused_rows=4, decode_fused_f32_rows=16,
        decode_pooled_any_context=True,
    )  # fmt: skip
    cost = EngineCost.from_profile(SPEC, FP32, 0.0, profile)
    w = sum(num_bytes for _, num_bytes in cost.bytes_by_format)  # every tensor fp32
    assert cost.terms_s(8, 10)["weights"] == pytest.approx(w / 6e9)  # fused: the panel GEMV
    assert cost.terms_s(16, 10)["weights"] == pytest.approx(w / 5e9)
    assert cost.terms_s(2, 10)["weights"] == pytest.approx(w / 9e9)
    per_op = replace(cost, fused_rows=4)  # an int8-row limit: 8 rows take oneDNN's rate
    assert per_op.terms_s(8, 10)["weights"] == pytest.approx(w / 40e9)
    # without panel points the small-row rate is held
    old = EngineCost.from_profile(SPEC, FP32, 0.0, replace(profile, points=PER_OP + FUSED
                                                           + rates[:4]))  # fmt: skip
    assert old.terms_s(16, 10)["weights"] == pytest.approx(w / 8e9)


def test_host_points_are_medians_of_rounds_so_one_slow_round_does_not_move_them(monkeypatch):
    import kvserve.lab.measure_engine as me
    from kvserve.lab.measure import MeasureConfig

    calls = []

    def fake_decoder(num_layers, fused, context=64):
        def make_step(batch):
            def step():
                return None

            step.layers = num_layers
            return step

        return make_step, None

    def fake_timer(fn, cfg):
        calls.append(fn.layers)
        slow = 5e-3 if len(calls) in (3, 4) and fn.layers > 1 else 0.0  # round 2's many-layer call
        return 1e-3 + fn.layers * 1e-4 + slow

    monkeypatch.setattr(me, "tiny_decoder", fake_decoder)
    monkeypatch.setattr(me, "time_median_s", fake_timer)
    monkeypatch.setattr(me, "fused_rows", lambda: 0)
    points = me.measure_dispatch(MeasureConfig(dispatch_rounds=3), dispatch_layers=8, rows=(1,))
    assert calls == [1, 9, 9, 1, 1, 9]  # one / many alternating which goes first
    got = {p.kind: p.median_s for p in points}
    assert got["dispatch"] == pytest.approx(1e-4)
    assert got["dispatch-fixed"] == pytest.approx(1e-3)


def test_the_overhead_engine_holds_every_rows_prompt_and_output(monkeypatch, tmp_path):
    """Review: a fixed 512 MiB cache held 64 rows of 48 tokens only below ~170 KiB a token; a 3B
    model's fp32 cache (~229 KiB) would preempt, no step would decode every row, and the 64-row
    points would be dropped unsaid. The cache is sized from the model's K and V bytes a token."""
    import json

    import kvserve.engine.llm as llm_mod
    from kvserve.lab.measure_overhead import measure_overhead

    config = {"model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 8192, "vocab_size": 128256,
              "max_position_embeddings": 8192}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(model_dir, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(llm_mod, "LLM", fake_llm)
    with pytest.raises(Stop):
        measure_overhead(str(tmp_path), rows=(1, 64), prompt_len=32, new_tokens=16)
    per_token = 2 * 28 * 8 * 128 * 4
    assert seen["kv_cache_memory_bytes"] >= 64 * (32 + 16) * per_token > 512 << 20
