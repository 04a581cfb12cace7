"""The pooled step's host cost on a model's own layer shapes (kvserve/lab/measure_pool.py,
docs/planning.md): the arithmetic on known timings, the real measurement's shape, and
`measure_engine` with a model putting it in place of the tiny decoder's slope."""

from __future__ import annotations

import pytest

from kvserve.lab.measure import MeasureConfig
from kvserve.lab.measure_engine import fused_rows
from kvserve.lab.plan.model import ModelSpec

WIDE = ModelSpec(
    name="wide", hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=256, vocab_size=100, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip
QUICK = MeasureConfig(warmup=1, min_samples=2, min_time_s=0.0, dispatch_rounds=1)
needs_fused = pytest.mark.skipif(not fused_rows(), reason="no fused step here")


@needs_fused
def test_the_host_per_layer_is_the_step_less_its_gemvs_and_the_fixed_part(monkeypatch):
    import kvserve.lab.measure_pool as mt

    seen = []

    def fake_medians(calls, cfg, rounds):
        seen.append(sorted(calls))
        for call in calls.values():  # the calls are real: the fused step runs, the GEMVs too
            call()
        rows = len(seen)
        # step 10 ms + 1 ms a row; the GEMVs 6 ms, of which 1 ms is the per-call cost
        return {0: 10e-3 + rows * 1e-3, 1: 6e-3, 2: 1e-3}

    monkeypatch.setattr(mt, "interleaved_medians_s", fake_medians)
    fixed = [(1, 2e-3), (4, 3e-3)]
    points = mt.measure_pool_host(QUICK, WIDE, fixed, rows=(1, 4))
    assert seen == [[0, 1, 2], [0, 1, 2]]
    got = {p.num_columns: p.median_s for p in points}
    assert all(p.kind == "fused-dispatch" for p in points)
    # (step - (gemvs - per-call cost) - fixed) / layers
    assert got[1] == pytest.approx((11e-3 - 5e-3 - 2e-3) / 3)
    assert got[4] == pytest.approx((12e-3 - 5e-3 - 3e-3) / 3)


@needs_fused
def test_the_host_is_never_negative(monkeypatch):
    import kvserve.lab.measure_pool as mt

    def fake_medians(calls, cfg, rounds):
        for call in calls.values():
            call()
        return {0: 1e-3, 1: 9e-3, 2: 1e-3}  # GEMVs slower than the step: a noisy pair

    monkeypatch.setattr(mt, "interleaved_medians_s", fake_medians)
    (point,) = mt.measure_pool_host(QUICK, WIDE, [(1, 1e-3)], rows=(1,))
    assert point.median_s == 0.0


@needs_fused
def test_measure_engine_with_a_model_takes_the_pooled_host_from_its_shapes(monkeypatch):
    import kvserve.lab.measure_pool as mt

    calls = []
    real = mt.measure_pool_host

    def spy(cfg, model, fused_fixed, **kwargs):
        calls.append((model.name, sorted(fused_fixed)))
        return real(cfg, model, fused_fixed, rows=(1, 2), **kwargs)

    monkeypatch.setattr(mt, "measure_pool_host", spy)
    cfg = MeasureConfig(gemv_rows=128, gemv_cols=64, warmup=1, min_samples=2, min_time_s=0.0,
                        attention_contexts=(16, 64), attention_cache_bytes=1e5,
                        dispatch_rounds=1)  # fmt: skip
    points = mt.measure_engine_on_model(cfg, ("fp32",), WIDE, budget_s=0.0)
    (call,) = calls
    fixed_rows = sorted(p.num_columns for p in points if p.kind == "fused-fixed")
    assert call[0] == "wide" and [n for n, _ in call[1]] == fixed_rows
    # the tiny decoder's slope is replaced: only the model-shaped rows remain
    assert sorted(p.num_columns for p in points if p.kind == "fused-dispatch") == [1, 2]
    assert all(p.median_s >= 0 for p in points if p.kind == "fused-dispatch")
