"""The pooled path priced from the pooled step's own layers (`pool-layer:FMT`) and the head module
(`head:FMT`), docs/planning.md "The pooled step's own layers": the fit and the step by hand on
synthetic points, the scaling to another model's shapes, the per-op path left alone, and the
measurement's arithmetic on a quantised decoder of a model's shapes."""

from __future__ import annotations

import json

import pytest

from kvserve.lab.measure import MeasureConfig
from kvserve.lab.measure_engine import fused_rows
from kvserve.lab.plan import arith, load_model, make_plan, parse_weight_format
from kvserve.lab.plan.engine_cost import EngineCost
from kvserve.lab.plan.hardware import HardwareProfile, MeasuredPoint
from kvserve.lab.plan.model import ModelSpec
from tests import REPO_ROOT

TIED = ModelSpec(
    name="tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=100, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip
WIDE = ModelSpec(
    name="wide", hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=256, vocab_size=100, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip
KV_TOKEN = 2 * 2 * 16 * 4  # K and V bytes of a token of one layer of TIED, fp32


def pt(kind, rows, bytes_per_s=0.0, median_s=0.0, context=0, kv_token=0):
    return MeasuredPoint(kind, rows, 0.0, bytes_per_s, 0.0, median_s, context, kv_token)


def layer_bytes(model, fmt="fp32"):
    return parse_weight_format(fmt).bytes_by_category(model)["linear"] / model.num_layers


def pool_points(model, fmt, rows, at_16_s, per_token_s):
    """pool-layer points at contexts 16 and 1016: at_16_s + per_token_s x (context - 16)."""
    out = []
    for c in (16, 1016):
        t = at_16_s + per_token_s * (c - 16)
        out.append(pt(f"pool-layer:{fmt}", rows, layer_bytes(model, fmt) / t, t, c, KV_TOKEN))
    return out


BASE = (
    pt("gemv", 1, 1e9),
    pt("linear:fp32", 1, 1e9),
    pt("linear:fp32", 4, 0.5e9),
    pt("dispatch", 1, median_s=1e-4),
    pt("dispatch", 16, median_s=1e-4),
    pt("dispatch-fixed", 1, median_s=1e-3),
    pt("dispatch-fixed", 16, median_s=1e-3),
    pt("fused-dispatch", 1, median_s=5e-5),
    pt("fused-dispatch", 4, median_s=5e-5),
    pt("fused-fixed", 1, median_s=2e-4),
    pt("fused-fixed", 4, median_s=4e-4),
)


def cost(points, fmt="fp32", model=TIED, peak=1e15):
    hw = HardwareProfile("m", 1e12, 1e9, peak, "fp32", measured=True, points=points,
                         decode_fused_rows=4, decode_fused_f32_rows=4,
                         decode_pooled_any_context=True)  # fmt: skip
    k = arith.kv_bytes_per_token(model, 4)
    return EngineCost.from_profile(model, parse_weight_format(fmt), k, hw)


def test_the_pooled_path_is_its_layers_plus_the_head_and_the_fixed_part_by_hand():
    points = BASE + tuple(
        pool_points(TIED, "fp32", 1, 1e-3, 1e-6) + pool_points(TIED, "fp32", 4, 2e-3, 3e-6)
    ) + (pt("head:fp32", 1, 2e9), pt("head:fp32", 4, 1e9))  # fmt: skip
    c = cost(points)
    head_bytes = parse_weight_format("fp32").bytes_by_category(TIED)["embed"]
    norm_bytes = parse_weight_format("fp32").bytes_by_category(TIED)["norm"]
    t = c.terms_s(1, 500)
    assert c.path(1, 500) == "pooled"
    # the layers at no context (1e-3 - 16 x 1e-6 each), the head at its own rate, norms at linear's
    assert t["weights"] == pytest.approx(2 * (1e-3 - 16e-6) + head_bytes / 2e9 + norm_bytes / 1e9)
    assert t["kv"] == pytest.approx(2 * 1e-6 * 500)  # the pooled step's own cache read, per token
    assert t["dispatch"] == pytest.approx(2e-4)  # the fixed part only: the layers hold their host
    # halfway (log2) between 1 and 4 rows
    t2 = c.terms_s(2, 500)
    assert t2["kv"] == pytest.approx(2 * 2e-6 * 500)
    assert t2["weights"] == pytest.approx(
        2 * ((1e-3 - 16e-6) + (2e-3 - 48e-6)) / 2 + head_bytes / 1.5e9 + norm_bytes / 0.75e9
    )


def test_without_pool_layer_points_the_pooled_path_is_priced_as_before():
    old = cost(BASE).terms_s(1, 500)
    with_head_only = cost(BASE + (pt("head:fp32", 1, 2e9),)).terms_s(1, 500)
    assert old["dispatch"] == pytest.approx(2 * 5e-5 + 2e-4)
    assert with_head_only["weights"] < old["weights"]  # the head at its own (faster) rate
    assert with_head_only["kv"] == old["kv"] and with_head_only["dispatch"] == old["dispatch"]


def test_the_per_op_path_and_other_formats_ignore_the_fp32_pooled_layers():
    points = BASE + tuple(pool_points(TIED, "fp32", 1, 1e-3, 1e-6))
    per_op = cost(points).terms_s(16, 500)
    assert per_op["dispatch"] == pytest.approx(2 * 1e-4 + 1e-3)  # the per-op host, per layer
    int8 = cost(points, "linear=int8,embed=fp32,head=fp32,norm=fp32")
    assert int8.terms_s(1, 500)["dispatch"] == pytest.approx(2 * 5e-5 + 2e-4)  # no int8 layers
    quant = points + tuple(pool_points(TIED, "int8", 1, 4e-4, 1e-6))
    t = cost(quant, "linear=int8,embed=fp32,head=fp32,norm=fp32").terms_s(1, 500)
    assert t["dispatch"] == pytest.approx(2e-4) and t["kv"] == pytest.approx(1e-3)


def test_a_model_of_other_shapes_scales_the_measured_layer_by_its_bytes():
    points = BASE + tuple(pool_points(TIED, "fp32", 1, 1e-3, 1e-6))
    t = cost(points, model=WIDE).terms_s(1, 100)
    w_scale = layer_bytes(WIDE) / layer_bytes(TIED)
    kv_scale = (2 * 2 * 32 * 4) / KV_TOKEN
    head = parse_weight_format("fp32").bytes_by_category(WIDE)
    assert t["kv"] == pytest.approx(3 * 1e-6 * kv_scale * 100)
    assert t["weights"] == pytest.approx(
        3 * (1e-3 - 16e-6) * w_scale + (head["embed"] + head["norm"]) / 1e9
    )


QUICK = MeasureConfig(warmup=1, min_samples=2, min_time_s=0.0, dispatch_rounds=1,
                      attention_contexts=(32, 64))  # fmt: skip


@pytest.mark.skipif(not fused_rows(), reason="no fused step here")
@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16"])
def test_the_measurement_is_the_fused_step_less_its_fixed_part_on_the_models_shapes(
    monkeypatch, fmt
):
    import kvserve.lab.measure_pool as mt

    seen = []

    def fake_medians(calls, cfg, rounds):
        seen.append(sorted(calls))
        for call in calls.values():  # the calls are real: the fused step runs
            call()
        return {16: 4e-3, 64: 7e-3}

    monkeypatch.setattr(mt, "interleaved_medians_s", fake_medians)
    points = mt.measure_pool_layers(QUICK, WIDE, fmt, [(1, 1e-3), (4, 1e-3)], rows=(1, 4, 16))
    rows = sorted({p.num_columns for p in points})
    assert rows == [n for n in (1, 4, 16) if n <= fused_rows()]  # quantised steps as many as fp32
    assert seen == [[16, 64]] * len(rows)
    by = {(p.num_columns, p.context_tokens): p for p in points}
    assert by[(1, 16)].median_s == pytest.approx((4e-3 - 1e-3) / 3)
    assert by[(1, 64)].median_s == pytest.approx((7e-3 - 1e-3) / 3)
    assert all(p.kind == f"pool-layer:{fmt}" and p.kv_token_bytes == 2 * 2 * 32 * 4 for p in points)
    # bytes_per_s x median_s is the planner's bytes of one layer in this format
    assert by[(1, 16)].bytes_per_s * by[(1, 16)].median_s == pytest.approx(layer_bytes(WIDE, fmt))


def test_the_head_points_count_the_heads_bytes_over_its_streaming_time(monkeypatch):
    import kvserve.lab.measure_pool as mt

    monkeypatch.setattr(mt, "interleaved_medians_s", lambda calls, cfg, rounds: {0: 3e-3, 1: 1e-3})
    (p,) = mt.measure_head(QUICK, WIDE, "int8", rows=(2,))
    from kvserve.lab.plan.formats import parse_tensor_format
    from kvserve.lab.plan.model import TensorShape

    num_bytes = parse_tensor_format("int8").num_bytes(TensorShape("h", "head", 100, 128))
    assert p.kind == "head:int8" and p.num_columns == 2
    assert p.bytes_per_s == pytest.approx(num_bytes / 2e-3)


def test_a_step_timed_whole_at_its_rows_takes_no_flops_floor():
    """The GEMM probe's peak is below what the engine's own kernels reach (1204c: int8 at 16 rows
    and int4 at 4 and 16 were planned 1.2-1.8x their steps by the floor). The pooled layers time
    the step's FLOPs at their rows, so there the floor does not apply; past the timed rows (the
    points held constant) and on the per-op path it still does."""
    points = BASE + tuple(pool_points(TIED, "fp32", 1, 4e-4, 1e-6))
    c = cost(points, peak=1e3)  # a floor far above every measured term
    t = c.terms_s(1, 500)
    assert c.path(1, 500) == "pooled" and t["compute"] > 1.0
    assert c.decode_step_s(1, 500) == pytest.approx(t["weights"] + t["kv"] + t["dispatch"])
    assert c.decode_bound(1, 500) != "compute"
    assert c.path(4, 500) == "pooled"  # pooled path, but 4 rows were not timed: floored
    assert c.decode_step_s(4, 500) == pytest.approx(c.terms_s(4, 500)["compute"])
    assert c.decode_bound(4, 500) == "compute"
    assert cost(BASE, peak=1e3).decode_step_s(1, 500) == pytest.approx(t["compute"])  # no layers
    # review: times scaled to another model's shapes, or to a smaller KV cache, scale bytes and
    # not FLOPs: those steps were not timed whole, and keep the floor
    wide = cost(points, model=WIDE, peak=1e3)
    assert wide.path(1, 500) == "pooled" and wide.decode_bound(1, 500) == "compute"
    hw = HardwareProfile("m", 1e12, 1e9, 1e3, "fp32", measured=True, points=points,
                         decode_fused_rows=4, decode_fused_f32_rows=4,
                         decode_pooled_any_context=True)  # fmt: skip
    int8_kv = EngineCost.from_profile(
        TIED, parse_weight_format("fp32"), arith.kv_bytes_per_token(TIED, 1), hw
    )
    assert int8_kv.decode_step_s(1, 500) == pytest.approx(int8_kv.terms_s(1, 500)["compute"])


def test_bf16_products_are_one_kernel_at_every_row_count():
    """`linear:bf16` is the bf16-product module (its kernel at every row count), not an fp32 one
    that changes kernel above the small rows: the step interpolates across them."""
    pts = BASE + (pt("linear:bf16", 1, 2e9), pt("linear:bf16", 16, 1e9))
    hw = HardwareProfile("m", 1e12, 1e9, 1e15, "fp32", measured=True, points=pts,
                         decode_fused_rows=4, decode_fused_f32_rows=4)  # fmt: skip
    k = arith.kv_bytes_per_token(TIED, 4)
    fmt = "linear=bf16,embed=fp32,head=fp32,norm=fp32"
    c = EngineCost.from_profile(TIED, parse_weight_format(fmt), k, hw)
    by = parse_weight_format(fmt).bytes_by_category(TIED)
    at_4 = 1.5e9  # halfway from 1 to 16 rows in log2
    rest = (by["embed"] + by["head"] + by["norm"]) / 0.5e9  # fp32: linear:fp32 at 4 rows
    assert c.path(4, 10) == "fused"
    assert c.terms_s(4, 10)["weights"] == pytest.approx(by["linear"] / at_4 + rest)


@pytest.mark.skipif(not fused_rows(), reason="no fused step here")
def test_bf16_is_measured_on_the_bf16_product_modules_the_loader_builds():
    """`--measure-formats bf16` times what `--quantization linear=bf16,head=bf16` runs: the block
    linears, the head and the linear points as bf16-product modules, the step fused."""
    import torch

    from kvserve.lab.measure_engine import tiny_decoder
    from kvserve.model.linear import make_linear
    from kvserve.quant.scheme import parse_tensor_scheme

    bf16 = parse_tensor_scheme("bf16")
    make_step, model = tiny_decoder(2, True, 64, 4, WIDE, bf16)
    linears = [m for m in model.layers.modules() if hasattr(m, "bf16_products")]
    assert len(linears) == 2 * 4 and all(m.bf16_products for m in linears)
    with torch.inference_mode():
        make_step(4, 32)()
    assert model.fused is not None and model.fused.num_steps == 1
    assert make_linear(torch.randn(32, 64), None, bf16).bf16_products
    assert not getattr(make_linear(torch.randn(32, 64), None, None), "bf16_products", False)


def test_the_pooled_layers_the_head_and_the_engine_are_timed_at_every_row_count_the_step_takes():
    """A profile timed the pooled layers and the head at 1, 4 and 16 rows while the engine fuses
    steps of up to 64: steps of 17-64 rows were priced from the 16-row points held, under the
    FLOPs floor at the GEMM probe's peak (1206: measured / plan 0.73-1.47 at 32 and 48 rows).
    Their default rows now reach the fused step's, as does the engine outside the forward."""
    import inspect

    import kvserve.lab.measure_pool as mt
    from kvserve.lab.measure_overhead import OVERHEAD_ROWS

    most = fused_rows() or 64  # the fused step's rows (64 where the kernels are built)
    for fn in (mt.measure_pool_layers, mt.measure_head):
        assert max(inspect.signature(fn).parameters["rows"].default) >= most
    assert max(OVERHEAD_ROWS) >= most
    # and the plan at 48 rows from points up to 64 is not floored: it lies between 32 and 64
    points = BASE + tuple(
        p
        for r, s in ((1, 4e-4), (32, 6e-4), (64, 1e-3))
        for p in pool_points(TIED, "fp32", r, s, 1e-6)
    )
    hw = HardwareProfile("m", 1e12, 1e9, 1e3, "fp32", measured=True, points=points,
                         decode_fused_rows=64, decode_fused_f32_rows=64,
                         decode_pooled_any_context=True)  # fmt: skip
    c = EngineCost.from_profile(
        TIED, parse_weight_format("fp32"), arith.kv_bytes_per_token(TIED, 4), hw
    )
    assert c.path(48, 500) == "pooled" and c.decode_bound(48, 500) != "compute"
    assert c.decode_step_s(32, 500) < c.decode_step_s(48, 500) < c.decode_step_s(64, 500)


@pytest.mark.skipif(fused_rows() < 64, reason="no 64-row fused step here")
def test_past_16_rows_the_pooled_layers_are_timed_at_the_context_16_rows_cache_holds(monkeypatch):
    """Review: 64 rows at the longest context need 4x the cache of 16 (a 3B model's layers at 64 x
    2,048 tokens would not fit 24 GB). The cache holds 16 rows at the longest context; 32 and 64
    rows are timed at the longest context that cache holds, and the fit takes each row count's
    own two contexts."""
    import kvserve.lab.measure_pool as mt

    built, seen = [], {}
    real = mt.tiny_decoder

    def spy(*args, **kwargs):
        built.append(args[6] if len(args) > 6 else kwargs.get("cache_rows"))
        return real(*args, **kwargs)

    def fake_medians(calls, cfg, rounds):
        for call in calls.values():  # the real steps run: each fits the cache
            call()
        seen.setdefault(len(seen), sorted(calls))
        return {c: 1e-3 + 1e-6 * c for c in calls}

    monkeypatch.setattr(mt, "tiny_decoder", spy)
    monkeypatch.setattr(mt, "interleaved_medians_s", fake_medians)
    cfg = MeasureConfig(warmup=1, min_samples=2, min_time_s=0.0, dispatch_rounds=1,
                        attention_contexts=(16, 256))  # fmt: skip
    points = mt.measure_pool_layers(cfg, WIDE, "fp32", [(1, 1e-4)], rows=(1, 16, 32, 64))
    assert built == [16]  # 16 rows of 256 tokens, not 64
    assert list(seen.values()) == [[16, 256], [16, 256], [16, 112], [16, 48]]
    assert sorted({(p.num_columns, p.context_tokens) for p in points}) == [
        (1, 16), (1, 256), (16, 16), (16, 256), (32, 16), (32, 112), (64, 16), (64, 48)
    ]  # fmt: skip
    assert mt.row_contexts((16, 256), 64, 16 * 17) == (16, 48)
    with pytest.raises(ValueError, match="do not fit"):
        real(1, True, 256, 64, WIDE, None, 16)[0](64, 256)


def _point(kind, rows, bytes_per_s=0.0, median_s=0.0, context=0, kv_token=0):
    return {"kind": kind, "num_columns": rows, "flops_per_s": 0.0, "bytes_per_s": bytes_per_s,
            "intensity_flops_per_byte": 0.0, "median_s": median_s, "context_tokens": context,
            "kv_token_bytes": kv_token}  # fmt: skip


# A profile as `kvserve plan --measure` saved it before the pooled step had its name: the fields
# `decode_team_*` and the kind `team-layer:FMT`.
EARLIER_PROFILE = {
    "name": "earlier", "memory_bytes": 1e12, "bandwidth_bytes_per_s": 1e9,
    "peak_flops_per_s": 1e15, "compute_dtype": "fp32", "measured": True,
    "decode_fused_rows": 4, "decode_fused_f32_rows": 4,
    "decode_team_any_context": True, "decode_team_values": 0,
    "points": [
        _point("linear:fp32", 1, 1e9), _point("linear:fp32", 4, 0.5e9),
        _point("dispatch", 1, median_s=1e-4), _point("dispatch", 16, median_s=1e-4),
        _point("dispatch-fixed", 1, median_s=1e-3), _point("dispatch-fixed", 16, median_s=1e-3),
        _point("fused-dispatch", 1, median_s=5e-5), _point("fused-dispatch", 4, median_s=5e-5),
        _point("fused-fixed", 1, median_s=2e-4), _point("fused-fixed", 4, median_s=4e-4),
        _point("team-layer:fp32", 1, 4e7, 1e-3, 16, KV_TOKEN),
        _point("team-layer:fp32", 1, 2e7, 2e-3, 1016, KV_TOKEN),
    ],
}  # fmt: skip


def _with_current_names(earlier: dict) -> dict:
    """The same profile as `kvserve plan --measure` saves it now."""
    text = json.dumps(earlier)
    text = text.replace('"decode_team_', '"decode_pooled_').replace('"team-layer:', '"pool-layer:')
    return json.loads(text)


def _plan(profile: HardwareProfile, model: ModelSpec) -> dict:
    return make_plan(model, profile, "fp32", "fp32").to_dict()


def test_a_profile_saved_with_the_earlier_names_gives_the_same_plan():
    current = _with_current_names(EARLIER_PROFILE)
    assert "decode_team_values" not in current and "team-layer" not in json.dumps(current)
    earlier_hw = HardwareProfile.from_dict(EARLIER_PROFILE)
    current_hw = HardwareProfile.from_dict(current)
    assert earlier_hw == current_hw
    assert earlier_hw.decode_pooled_any_context
    kinds = {p.kind for p in earlier_hw.points}
    assert "pool-layer:fp32" in kinds and "team-layer:fp32" not in kinds
    c = EngineCost.from_profile(TIED, parse_weight_format("fp32"), 0.0, earlier_hw)
    assert c.path(1, 500) == "pooled" and dict(c.pool_layers)["fp32"]
    assert _plan(earlier_hw, TIED) == _plan(current_hw, TIED)
    # the pooled step's fields and layers change the plan: without them it is another plan
    without = dict(current, decode_pooled_any_context=False)
    without["points"] = [p for p in current["points"] if not p["kind"].startswith("pool-layer:")]
    assert _plan(HardwareProfile.from_dict(without), TIED) != _plan(current_hw, TIED)


SAVED = REPO_ROOT / "benchmarks/results/zen3_avx2/session_1203g/plan_vs_measured.json"


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4-g32"])
def test_a_profile_measured_by_an_earlier_version_plans_as_with_the_current_names(fmt):
    """The profile of a plan-vs-measured run of session 1203g (SmolLM2-135M's shapes on a Zen 3),
    saved with `decode_team_*` and `team-layer:FMT`."""
    earlier = json.loads(SAVED.read_text())["profile"]
    assert earlier["decode_team_any_context"] is True
    assert any(p["kind"] == f"team-layer:{fmt}" for p in earlier["points"])
    earlier_hw = HardwareProfile.from_dict(earlier)
    current_hw = HardwareProfile.from_dict(_with_current_names(earlier))
    assert earlier_hw == current_hw
    spec = load_model("SmolLM2-135M")
    weights = "fp32" if fmt == "fp32" else f"linear={fmt},embed=fp32,head=fp32,norm=fp32"
    plan = make_plan(spec, earlier_hw, weights, "fp32")
    assert plan.to_dict() == make_plan(spec, current_hw, weights, "fp32").to_dict()
    c = EngineCost.from_profile(spec, parse_weight_format(weights), 0.0, earlier_hw)
    assert c.path(1, 128) == "pooled" and dict(c.pool_layers)[fmt]
