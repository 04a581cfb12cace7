"""The planner's decode step from a measured engine profile (kvserve.lab.plan.engine_cost): the
formula by hand, interpolation between measured batch sizes, the GEMV fallback for a format
without points, the bound it names, and the plan using it and saying so."""

from __future__ import annotations

import pytest

from kvserve.lab.plan import arith, make_plan, parse_weight_format
from kvserve.lab.plan.engine_cost import EngineCost
from kvserve.lab.plan.hardware import HardwareProfile, MeasuredPoint
from kvserve.lab.plan.model import ModelSpec

TIED = ModelSpec(
    name="tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=100, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip
GEMV_BW = 1e9


def point(kind: str, rows: int, bytes_per_s: float = 0.0, median_s: float = 0.0):
    return MeasuredPoint(kind, rows, 0.0, bytes_per_s, 0.0, median_s)


def profile(points: tuple[MeasuredPoint, ...]) -> HardwareProfile:
    return HardwareProfile("m", 1e12, GEMV_BW, 1e15, "fp32", measured=True, points=points)


MEASURED = (
    point("gemv", 1, GEMV_BW),
    point("linear:fp32", 1, 1e9),
    point("linear:fp32", 4, 0.5e9),
    point("dispatch", 1, median_s=1e-4),
    point("dispatch", 4, median_s=3e-4),
    point("dispatch-fixed", 1, median_s=1e-3),
    point("dispatch-fixed", 4, median_s=2e-3),
)


def test_decode_step_by_hand_and_interpolated_in_log2_batch():
    fmt = parse_weight_format("fp32")
    k = arith.kv_bytes_per_token(TIED, 4)
    cost = EngineCost.from_profile(TIED, fmt, k, profile(MEASURED))
    w = fmt.weight_bytes(TIED)
    # batch 1: W / 1e9 + k t / 1e9 + 2 layers x 1e-4 + 1e-3
    assert cost.decode_step_s(1, 100) == pytest.approx(w / 1e9 + k * 100 / 1e9 + 2e-4 + 1e-3)
    # batch 2 is halfway in log2 between 1 and 4: rate 0.75e9, 2e-4 per layer, 1.5e-3 fixed
    assert cost.decode_step_s(2, 100) == pytest.approx(
        w / 0.75e9 + 2 * k * 100 / 1e9 + 2 * 2e-4 + 1.5e-3
    )
    # beyond the largest measured batch the rates and host costs are held
    t = cost.terms_s(16, 100)
    assert t["weights"] == pytest.approx(w / 0.5e9) and t["dispatch"] == pytest.approx(2.6e-3)


def test_a_format_without_linear_points_streams_at_the_gemv_bandwidth():
    fmt = parse_weight_format("linear=int8,embed=fp32,head=fp32,norm=fp32")
    cost = EngineCost.from_profile(TIED, fmt, 0.0, profile(MEASURED))
    by = fmt.bytes_by_category(TIED)
    expected = by["linear"] / GEMV_BW + (by["embed"] + by["norm"]) / 1e9
    assert cost.terms_s(1, 0)["weights"] == pytest.approx(expected)
    assert "GEMV bandwidth" in cost.sources()["weights (int8)"]
    assert "measured per batch size" in cost.sources()["weights (fp32)"]


def test_bound_names_the_largest_part():
    fmt = parse_weight_format("fp32")
    cost = EngineCost.from_profile(TIED, fmt, 0.0, profile(MEASURED))
    # the tiny model's ~300 kB of weights stream in ~0.3 ms: the host cost (1.2 ms) is larger
    assert cost.decode_bound(1, 0) == "dispatch"
    no_linears = tuple(p for p in MEASURED if not p.kind.startswith("linear"))
    # a kernel 1000x slower than the GEMV bandwidth: the step is its inefficiency, not memory
    slow = no_linears + (point("linear:fp32", 1, 1e6),)
    assert EngineCost.from_profile(TIED, fmt, 0.0, profile(slow)).decode_bound(1, 0) == "kernel"
    # the same bytes at the GEMV bandwidth but with a host cost 1000x smaller: memory-bound
    fast_host = tuple(
        point(p.kind, p.num_columns, median_s=p.median_s / 1000) for p in no_linears[1:]
    ) + (point("linear:fp32", 1, GEMV_BW),)
    bound = EngineCost.from_profile(TIED, fmt, 0.0, profile(fast_host)).decode_bound(1, 0)
    assert bound == "memory"


def test_a_profile_without_dispatch_points_keeps_the_roofline():
    fmt = parse_weight_format("fp32")
    assert EngineCost.from_profile(TIED, fmt, 0.0, profile(MEASURED[:3])) is None
    plan = make_plan(TIED, profile(MEASURED[:3]), "fp32", "fp32")
    assert not any("measured engine profile" in n for n in plan.notes)


def test_the_plan_uses_the_measured_engine_profile_and_says_so():
    hw = profile(MEASURED)
    plan = make_plan(TIED, hw, "fp32", "fp32")
    k = arith.kv_bytes_per_token(TIED, 4)
    cost = EngineCost.from_profile(TIED, parse_weight_format("fp32"), k, hw)
    t = plan.workload.mean_decode_context
    assert plan.latency.tpot_solo_s == pytest.approx(cost.decode_step_s(1, t))
    note = next(n for n in plan.notes if "measured engine profile" in n)
    assert "dispatch: the engine's decoder at a tiny width" in note


def test_measure_engine_times_the_engines_own_modules():
    from kvserve.lab.measure import MeasureConfig
    from kvserve.lab.measure_engine import measure_engine

    cfg = MeasureConfig(gemv_rows=128, gemv_cols=64, warmup=1, min_samples=2, min_time_s=0.0,
                        attention_contexts=(16, 64), attention_cache_bytes=1e6)  # fmt: skip
    points = measure_engine(cfg, ("fp32", "int8"), budget_s=300.0)
    kinds = {p.kind for p in points}
    expected = {"dispatch", "dispatch-fixed", "attention", "attention-time", "linear:fp32",
                "linear:int8"}  # fmt: skip
    from kvserve.lab.measure_engine import fused_rows

    if fused_rows():  # the C kernels built here: the fused step is a step shape of its own
        from kvserve.model import fused_decode

        expected |= {"fused-dispatch", "fused-fixed"}
        fused = sorted(p.num_columns for p in points if p.kind == "fused-dispatch")
        assert fused[-1] == fused_rows() and fused[0] == 1
        if fused_decode.max_step_rows() > fused_decode.max_rows():  # fp32 steps of 64 rows
            expected.add("linear-fused:fp32")
            panel = [p for p in points if p.kind == "linear-fused:fp32"]
            assert [p.num_columns for p in panel] == [8, 16, 32, 64]
            assert panel[0].bytes_per_s * panel[0].median_s == pytest.approx(4 * 128 * 64)
    assert kinds == expected
    assert all(p.bytes_per_s > 0 for p in points if p.kind == "attention")
    timed = [(p.num_columns, p.context_tokens) for p in points if p.kind == "attention-time"]
    assert sorted(timed) == [(n, c) for n in (1, 4, 16) for c in (16, 64)]
    fp32 = [p for p in points if p.kind == "linear:fp32"]
    assert [p.num_columns for p in fp32] == [1, 2, 4, 8, 16, 32]
    # bytes/s x seconds = the matrix's fp32 bytes; int8 counts codes + one fp16 scale per row
    assert fp32[0].bytes_per_s * fp32[0].median_s == pytest.approx(4 * 128 * 64)
    int8 = next(p for p in points if p.kind == "linear:int8")
    assert int8.bytes_per_s * int8.median_s == pytest.approx(128 * 64 + 2 * 128)
    assert all(p.median_s >= 0 for p in points if p.kind.startswith("dispatch"))


def test_linears_over_a_models_own_matrices_count_the_planners_bytes():
    from kvserve.lab.measure import MeasureConfig
    from kvserve.lab.measure_engine import linear_shapes, measure_linear

    cfg = MeasureConfig(warmup=1, min_samples=2, min_time_s=0.0)
    shapes = linear_shapes(cfg, TIED)
    # per layer: q/k/v fused (64 + 2 x 32) x 64, o 64 x 64, gate/up 256 x 64, down 64 x 128
    assert shapes == [(128, 64), (64, 64), (256, 64), (64, 128)] * 2
    points = measure_linear(cfg, "fp32", deadline=float("inf"), rows=(2,), model=TIED)
    assert [p.num_columns for p in points if p.kind == "linear:fp32"] == [2]
    for p in points:  # and the fused step's panel GEMV above 4 rows, where it is built
        assert p.bytes_per_s * p.median_s == pytest.approx(4 * sum(o * i for o, i in shapes))


def test_the_kv_term_reads_at_the_measured_attention_rate():
    fmt = parse_weight_format("fp32")
    k = arith.kv_bytes_per_token(TIED, 4)
    hw = profile(MEASURED + (point("attention", 1, 2e8), point("attention", 4, 4e8)))
    cost = EngineCost.from_profile(TIED, fmt, k, hw)
    assert cost.terms_s(1, 1000)["kv"] == pytest.approx(k * 1000 / 2e8)
    assert cost.terms_s(4, 1000)["kv"] == pytest.approx(4 * k * 1000 / 4e8)
    assert "decode attention" in cost.sources()["kv"]


def test_attention_points_are_medians_of_interleaved_rounds():
    """One slow phase of the machine must not set an attention point (the profile's 4 x 2000
    point was one timing, shared by every format's plan): each point is the median over rounds,
    the contexts A B, then B A."""
    from kvserve.lab.measure import MeasureConfig
    from kvserve.lab.measure_engine import interleaved_medians_s

    order: list[int] = []
    # the machine is slow (10x) during the second round only
    script = iter([1.0, 2.0, 20.0, 10.0, 1.0, 2.0])

    def timer(call, cfg) -> float:
        call()
        return next(script)

    calls = {128: lambda: order.append(128), 2000: lambda: order.append(2000)}
    medians = interleaved_medians_s(calls, MeasureConfig(), 3, timer=timer)
    assert order == [128, 2000, 2000, 128, 128, 2000]
    assert medians == {128: 1.0, 2000: 2.0}
    with pytest.raises(ValueError, match="attention_rounds"):
        MeasureConfig(attention_rounds=0)
