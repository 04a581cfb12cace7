"""The engine probes of `kvserve plan --measure` stream their weights from memory, as a decode
step does, not from the last-level cache (docs/planning.md, "Probes stream from memory"): the
cache size from sysfs, the copies each probe cycles through, and the head and pool-layer probes
built on them."""

from __future__ import annotations

import pytest
import torch

import kvserve.lab.measure as measure
from kvserve.lab.measure import MeasureConfig, last_level_cache_bytes, stream_copies
from kvserve.lab.measure_engine import fused_rows, step_weight_bytes
from kvserve.lab.plan.model import ModelSpec

QUICK = MeasureConfig(warmup=1, min_samples=2, min_time_s=0.0, dispatch_rounds=1,
                      attention_contexts=(32, 64))  # fmt: skip


def _shape(num_layers: int, vocab_size: int = 100) -> ModelSpec:
    return ModelSpec(
        name="probe", hidden_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip


def test_the_last_level_cache_is_the_largest_cache_sysfs_lists(tmp_path):
    for name, size in (("index0", "32K"), ("index2", "512K"), ("index3", "32768K"),
                       ("index4", "junk")):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    (tmp_path / "index5").mkdir()  # no size file
    assert last_level_cache_bytes("cpu", tmp_path) == 32 << 20
    (tmp_path / "index6").mkdir()
    (tmp_path / "index6" / "size").write_text("1M")
    assert last_level_cache_bytes("cpu", tmp_path) == 32 << 20
    assert last_level_cache_bytes("cpu", tmp_path / "missing") == measure.DEFAULT_LLC_BYTES


def test_copies_cover_the_steps_weights_up_to_8x_the_cache(monkeypatch):
    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda device="cpu": 1 << 20)
    mib = float(1 << 20)
    assert stream_copies(3 * mib) == 3  # no step: 8 MiB, 8x the cache
    assert stream_copies(3 * mib, 2 * mib) == 1  # a step that reads less: one copy
    assert stream_copies(1 * mib, 5 * mib) == 5  # the step's 5 MiB
    assert stream_copies(1 * mib, 100 * mib) == 8  # 8x the cache at most
    assert stream_copies(64 * mib, 100 * mib) == 1
    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda device="cpu": 1 << 30)
    assert stream_copies(256 * mib) == 4  # and at most 1 GiB


def test_the_step_reads_every_layers_linears_and_the_head():
    model = _shape(3)
    per_layer = (64 + 2 * 32) * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128  # q/k/v, o, gate/up, down
    assert step_weight_bytes(model, "fp32") == 4 * (3 * per_layer + 100 * 64)


def _head_bytes(model: ModelSpec, fmt: str) -> float:
    from kvserve.lab.plan.formats import parse_tensor_format
    from kvserve.lab.plan.model import TensorShape

    shape = TensorShape("head", "head", model.vocab_size, model.hidden_size)
    return parse_tensor_format(fmt).num_bytes(shape)


@pytest.mark.parametrize("fmt", ["int8", "fp32"])
def test_the_head_probe_cycles_through_copies_that_span_the_steps_weights(monkeypatch, fmt):
    """One head called over and over stays in the last-level cache (an int8 head of 28 MB ran
    1.7x faster so on a 32 MiB L3); the probe calls copies in turn, as many as make the step's
    weights, up to 8x the cache."""
    import kvserve.lab.measure_pool as mt

    model = _shape(2)
    head_bytes, step_bytes = _head_bytes(model, fmt), step_weight_bytes(model, fmt)
    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda device="cpu": int(step_bytes))
    copies = stream_copies(head_bytes, step_bytes)
    assert copies == -(-step_bytes // head_bytes) == 13  # the step's weights: two layers, a head

    def fake_medians(calls, cfg, rounds):
        for _ in range(2 * copies):
            calls[0]()
        return {0: 3e-3, 1: 1e-3}

    monkeypatch.setattr(mt, "interleaved_medians_s", fake_medians)
    seen: list[int] = []  # the heads called (out_features = the vocabulary), in order
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(id(m)) if getattr(m, "out_features", 0) == 100 else None
    )
    try:
        (p,) = mt.measure_head(QUICK, model, fmt, rows=(1,))
    finally:
        handle.remove()
    assert len(seen) == 2 * copies
    assert len(set(seen)) == copies  # every copy, in turn
    assert seen[:copies] == seen[copies:]
    assert p.bytes_per_s == pytest.approx(head_bytes / 2e-3)  # one head's bytes a call


@pytest.mark.skipif(not fused_rows(), reason="no fused step here")
def test_the_pool_layer_probe_takes_enough_of_the_models_layers_to_leave_the_cache(monkeypatch):
    """12 layers of int4 fit in a 32 MiB cache: the probe's decoder has as many of the model's
    layers as make the step's weights (up to 8x the cache), never more than the model has."""
    import kvserve.lab.measure_pool as mt

    model = _shape(40)
    layer_bytes, _ = mt._layer_bytes(model, "int8")

    def fake_medians(calls, cfg, rounds):
        for call in calls.values():  # the calls are real: the fused step runs
            call()
        return {16: 4e-3, 64: 7e-3}

    monkeypatch.setattr(mt, "interleaved_medians_s", fake_medians)
    monkeypatch.setattr(
        measure, "last_level_cache_bytes", lambda device="cpu": int(2 * layer_bytes)
    )
    points = mt.measure_pool_layers(QUICK, model, "int8", [(1, 1e-3)], rows=(1,))
    # (step - fixed) / layers: 16 layers, 8x the cache, not the 12 the probe took before
    assert points[0].median_s == pytest.approx((4e-3 - 1e-3) / 16)
    monkeypatch.setattr(
        measure, "last_level_cache_bytes", lambda device="cpu": int(8 * layer_bytes)
    )
    points = mt.measure_pool_layers(QUICK, model, "int8", [(1, 1e-3)], rows=(1,))
    assert points[0].median_s == pytest.approx((4e-3 - 1e-3) / 40)  # all of the model's 40
    points = mt.measure_pool_layers(QUICK, _shape(3), "int8", [(1, 1e-3)], rows=(1,))
    assert points[0].median_s == pytest.approx((4e-3 - 1e-3) / 3)  # a small model: its own 3


def test_the_linear_probe_streams_copies_and_counts_one_sets_bytes(monkeypatch):
    """Without a model: as many bytes as the fp32 matrices (int8 is a quarter: 4 copies); with
    one, the step's weights. bytes/s x seconds stays one set's bytes."""
    from kvserve.lab.measure_engine import measure_linear

    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda device="cpu": 1 << 30)
    cfg = MeasureConfig(gemv_rows=256, gemv_cols=128, warmup=1, min_samples=2, min_time_s=0.0)
    built: list[tuple[int, int]] = []
    import kvserve.model.linear as linear

    real = linear.make_linear

    def spy(weight, *args, **kwargs):
        built.append(tuple(weight.shape))
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(linear, "make_linear", spy)
    (p,) = measure_linear(cfg, "int8", deadline=float("inf"), rows=(1,))
    assert built.count((256, 128)) == 4
    assert p.bytes_per_s * p.median_s == pytest.approx(256 * 128 + 2 * 256)
