"""Step shapes in a measured engine profile (kvserve.lab.plan.engine_cost, docs/planning.md): the
fused decode step's host cost for the rows it takes, the per-op path above them or with a
quantised KV cache, linear rates not interpolated across the kernel change, the cache read from
attention timed per context, and an old profile without these entries still planning."""

from __future__ import annotations

import json

import pytest

from kvserve.lab.plan import arith, make_plan, parse_weight_format
from kvserve.lab.plan.engine_cost import EngineCost, attention_excess_s
from kvserve.lab.plan.hardware import HardwareProfile, MeasuredPoint, load_profile_file
from kvserve.lab.plan.model import ModelSpec

SPEC = ModelSpec(
    name="tiny", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=100, max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip
FP32 = parse_weight_format("fp32")


def pt(kind: str, rows: int, bytes_per_s: float = 0.0, median_s: float = 0.0, context: int = 0):
    return MeasuredPoint(kind, rows, 0.0, bytes_per_s, 0.0, median_s, context)


PER_OP = (
    pt("gemv", 1, 1e9),
    pt("dispatch", 1, median_s=4e-4),
    pt("dispatch", 16, median_s=8e-4),
    pt("dispatch-fixed", 1, median_s=2e-3),
    pt("dispatch-fixed", 16, median_s=3e-3),
)
FUSED = (
    pt("fused-dispatch", 1, median_s=2e-5),
    pt("fused-dispatch", 4, median_s=5e-5),
    pt("fused-fixed", 1, median_s=1e-4),
    pt("fused-fixed", 4, median_s=2e-4),
)


def hw(points, fused_rows: int = 4) -> HardwareProfile:
    return HardwareProfile(
        "m", 1e12, 1e9, 1e15, "fp32", measured=True, points=points, decode_fused_rows=fused_rows
    )


def test_a_fused_profile_prices_small_steps_with_the_fused_host_cost():
    cost = EngineCost.from_profile(SPEC, FP32, 0.0, hw(PER_OP + FUSED))
    assert cost.path(1) == "fused" and cost.path(4) == "fused" and cost.path(5) == "per-op"
    assert cost.terms_s(1, 0)["dispatch"] == pytest.approx(3 * 2e-5 + 1e-4)
    assert cost.terms_s(4, 0)["dispatch"] == pytest.approx(3 * 5e-5 + 2e-4)
    # above the fused rows: the per-op points (interpolated in log2 rows between 1 and 16)
    assert cost.terms_s(16, 0)["dispatch"] == pytest.approx(3 * 8e-4 + 3e-3)
    assert cost.terms_s(4 * 1.0001, 0)["dispatch"] > 3 * 5e-4
    assert "fused decode step (<= 4 rows" in cost.sources()["dispatch"]


def test_a_quantised_kv_cache_takes_the_per_op_path_even_for_one_row():
    cost = EngineCost.from_profile(SPEC, FP32, 0.0, hw(PER_OP + FUSED), fused_eligible=False)
    assert cost.path(1) == "per-op"
    assert cost.terms_s(1, 0)["dispatch"] == pytest.approx(3 * 4e-4 + 2e-3)


def test_the_plan_uses_the_fused_step_for_fp32_and_8bit_caches():
    """The fused step takes fp32, int8 and fp8 caches (model/fused_decode.py); a bf16 cache, which
    the CPU engine does not run, is priced on the per-op path."""
    profile = hw(PER_OP + FUSED)
    k32 = arith.kv_bytes_per_token(SPEC, 4)
    fused = EngineCost.from_profile(SPEC, FP32, k32, profile)
    plan = make_plan(SPEC, profile, "fp32", "fp32")
    t = plan.workload.mean_decode_context
    assert plan.latency.tpot_solo_s == pytest.approx(fused.decode_step_s(1, t))
    for kv in ("int8", "fp8"):
        plan_8 = make_plan(SPEC, profile, "fp32", kv)
        k8 = arith.kv_bytes_per_token(SPEC, plan_8.kv_bytes_per_value)
        fused_8 = EngineCost.from_profile(SPEC, FP32, k8, profile)
        assert fused_8.path(1, t) != "per-op"
        assert plan_8.latency.tpot_solo_s == pytest.approx(fused_8.decode_step_s(1, t))
    plan_bf16 = make_plan(SPEC, profile, "fp32", "bf16")
    k16 = arith.kv_bytes_per_token(SPEC, plan_bf16.kv_bytes_per_value)
    per_op = EngineCost.from_profile(SPEC, FP32, k16, profile, fused_eligible=False)
    assert plan_bf16.latency.tpot_solo_s == pytest.approx(per_op.decode_step_s(1, t))
    assert plan_bf16.latency.tpot_solo_s > plan.latency.tpot_solo_s


def test_linear_rates_are_not_interpolated_across_the_kernel_change():
    points = PER_OP + FUSED + (
        pt("linear:fp32", 1, 1e9), pt("linear:fp32", 4, 0.25e9),  # the small-row GEMV
        pt("linear:fp32", 8, 0.5e9), pt("linear:fp32", 16, 0.4e9),  # the batched kernel
    )  # fmt: skip
    cost = EngineCost.from_profile(SPEC, FP32, 0.0, hw(points))
    w = FP32.weight_bytes(SPEC)
    assert cost.terms_s(4, 0)["weights"] == pytest.approx(w / 0.25e9)
    # 6 rows run the batched kernel: held at its 8-row rate, not between 0.25e9 and 0.5e9
    assert cost.terms_s(6, 0)["weights"] == pytest.approx(w / 0.5e9)
    # a profile without fused rows (one kernel) interpolates across all of them
    one = EngineCost.from_profile(SPEC, FP32, 0.0, hw(points, fused_rows=0))
    assert one.terms_s(6, 0)["weights"] < w / 0.25e9 and one.terms_s(6, 0)["weights"] > w / 0.5e9


def test_the_cache_read_is_the_attention_timed_at_that_context_less_its_intercept():
    # 1 row: 10 us per layer at context 128, 100 us at 2048, 250 us at 4096 (slower per token)
    pts = ((128, 1e-5), (2048, 1e-4), (4096, 2.5e-4))
    slope = (1e-4 - 1e-5) / (2048 - 128)
    intercept = 1e-5 - 128 * slope
    assert attention_excess_s(pts, 2000) == pytest.approx(1e-5 + (2000 - 128) * slope - intercept)
    assert attention_excess_s(pts, 3000) == pytest.approx(
        1e-4 + (3000 - 2048) * (1.5e-4 / 2048) - intercept
    )
    points = PER_OP + FUSED + tuple(pt("attention-time", 1, median_s=s, context=c) for c, s in pts)
    cost = EngineCost.from_profile(SPEC, FP32, 1.0, hw(points))
    assert cost.terms_s(1, 2000)["kv"] == pytest.approx(3 * attention_excess_s(pts, 2000))
    assert "timed at contexts 128, 2048, 4096" in cost.sources()["kv"]


def test_an_old_profile_without_the_new_fields_still_loads_and_plans_per_op(tmp_path):
    data = hw(PER_OP + FUSED[:0] + (pt("attention", 1, 5e8),)).to_dict()
    del data["decode_fused_rows"]  # written before the fused step was measured
    for p in data["points"]:
        del p["context_tokens"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_profile_file(path)
    assert old.decode_fused_rows == 0 and all(p.context_tokens == 0 for p in old.points)
    cost = EngineCost.from_profile(SPEC, FP32, 1.0, old)
    assert cost.path(1) == "per-op"
    assert cost.terms_s(1, 100)["kv"] == pytest.approx(100 / 5e8)
    assert "no fused-step points" in cost.sources()["dispatch"]
    plan = make_plan(SPEC, old, "fp32", "fp32")
    assert any("no fused-step points" in n for n in plan.notes)


def test_attention_timed_on_another_models_cache_scales_with_its_bytes_per_token():
    """A profile timed on 4 KV heads x 64 fp32 (2,048 bytes per token and layer) prices a model
    with 4x the bytes per token at 4x the cache read, and a bf16 cache at half of it."""
    pts = ((128, 1e-5), (2048, 1e-4))
    points = PER_OP + FUSED + tuple(
        MeasuredPoint("attention-time", 1, 0.0, 0.0, 0.0, s, c, 2048) for c, s in pts
    )  # fmt: skip
    same = 3 * 2048  # SPEC's 3 layers at the measured bytes: unscaled
    base = EngineCost.from_profile(SPEC, FP32, same, hw(points)).terms_s(1, 2000)["kv"]
    assert base == pytest.approx(3 * attention_excess_s(pts, 2000))
    big = EngineCost.from_profile(SPEC, FP32, 4 * same, hw(points)).terms_s(1, 2000)["kv"]
    half = EngineCost.from_profile(SPEC, FP32, same / 2, hw(points)).terms_s(1, 2000)["kv"]
    assert big == pytest.approx(4 * base) and half == pytest.approx(base / 2)


def test_repeated_contexts_in_a_profile_do_not_break_the_plan():
    """Two points at the same context (a profile measured with `--measure-contexts 128,128,2048`
    before contexts were deduplicated) are averaged, not divided by a zero width."""
    pts = ((128, 1e-5), (128, 1.2e-5), (2048, 1e-4))
    points = PER_OP + FUSED + tuple(pt("attention-time", 1, median_s=s, context=c) for c, s in pts)
    cost = EngineCost.from_profile(SPEC, FP32, 1.0, hw(points))
    expected = attention_excess_s(((128, 1.1e-5), (2048, 1e-4)), 2000)
    assert cost.terms_s(1, 2000)["kv"] == pytest.approx(3 * expected)


def test_quantised_linear_rates_are_one_curve_across_the_fused_rows():
    """int8 / int4 run the panel GEMV at every row count: their rates interpolate across 4 rows
    (fp32's split would hold 6 rows at the 8-row rate, so 6 and 8 rows would cost the same)."""
    int8 = parse_weight_format("int8")
    points = PER_OP + FUSED + (pt("linear:int8", 4, 0.25e9), pt("linear:int8", 8, 0.5e9))
    cost = EngineCost.from_profile(SPEC, int8, 0.0, hw(points))
    four, six, eight = (cost.terms_s(n, 0)["weights"] for n in (4, 6, 8))
    assert four > six > eight
