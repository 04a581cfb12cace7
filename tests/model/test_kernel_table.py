"""The matrix-engine probe and the per-shape GEMM table (kvserve/model/kernel_choice.py,
kvserve/model/kernel_table.py): the decisions as pure functions, every candidate against an fp64
oracle, `--kernel-choice own` as the fixed rules, the on-disk cache, and what /manifest shows."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve import LLM
from kvserve.config import KERNEL_CHOICES
from kvserve.core.errors import InvalidRequestError
from kvserve.engine.args import EngineArgs
from kvserve.engine.info import engine_info
from kvserve.model import block_linear, fused_decode, kernel_table
from kvserve.model.block_linear import BlockLinear
from kvserve.model.block_weights import repack
from kvserve.model.kernel_choice import (
    XFEATURE_XTILEDATA,
    cpu_flags,
    decide_matrix_engine,
    probe_matrix_engine,
)
from kvserve.model.kernel_table import (
    ROW_BUCKETS,
    apply_kernel_choice,
    bucket_index,
    candidates_of,
    choose,
    table_choices,
)
from kvserve.model.linear import PackedLinear
from kvserve.server.manifest import build_manifest
from kvserve.server.startup import startup_summary
from tests.model.test_block_weights import quantized_blocks

AMX = {"amx_tile", "amx_bf16", "amx_int8", "avx2", "avx512_bf16", "avx512_vnni"}
GRANTED = 1 << XFEATURE_XTILEDATA | 0x3  # x87, SSE and XTILEDATA

needs_panels = pytest.mark.skipif(not fused_decode.max_rows(), reason="the C kernels did not build")


# --- the probe ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, rc, bits, torch_amx, label",
    [
        ({"avx2", "fma"}, None, None, None, "none: cpu flag absent"),  # Zen 3
        ({"amx_tile", "avx2"}, 0, GRANTED, True, "none: cpu flag absent"),  # no amx_bf16
        (AMX, -1, None, True, "none: os refused"),  # ARCH_REQ_XCOMP_PERM failed
        (AMX, 0, 0x3, True, "none: os refused"),  # asked, but XTILEDATA not granted
        (AMX, 0, None, True, "none: os refused"),  # the permission could not be read back
        (AMX, 0, GRANTED, False, "none: torch reports no amx"),
        (AMX, 0, GRANTED, None, "amx-bf16"),  # a torch without the query: the OS decides
        (AMX, 0, GRANTED, True, "amx-bf16"),
    ],
)
def test_the_matrix_engine_decision(flags, rc, bits, torch_amx, label):
    engine = decide_matrix_engine(frozenset(flags), rc, bits, torch_amx)
    assert engine.label == label
    assert engine.usable == (label == "amx-bf16")


def test_the_decision_reports_the_vector_extensions():
    zen3 = decide_matrix_engine(frozenset({"avx2", "fma"}), None, None, None)
    assert zen3.summary() == "amx: no (cpu flag absent); avx2 yes, avx512_bf16 no, vnni no"
    spr = decide_matrix_engine(frozenset(AMX), 0, GRANTED, True)
    assert spr.summary() == "amx: yes (int8 too); avx2 yes, avx512_bf16 yes, vnni yes"
    assert decide_matrix_engine(frozenset({"avx_vnni"}), None, None, None).vnni


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_tile\n\nflags : sse\n"
    )
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_the_real_probe_follows_this_machines_flags():
    """What this machine says. Without the AMX flags (this project's Zen 3) the OS is not even
    asked; with them, the verdict is one of the three the OS and torch can give."""
    engine = probe_matrix_engine()
    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        assert engine.label == "none: cpu flag absent"
        assert engine.summary().startswith("amx: no (cpu flag absent)")
    else:
        assert engine.label in ("amx-bf16", "none: os refused", "none: torch reports no amx")
    assert engine.avx2 == ("avx2" in cpu_flags())


# --- the table's rules -------------------------------------------------------------------------------


def test_row_buckets():
    assert [bucket_index(m) for m in (0, 1, 2, 3, 4, 5, 16, 17, 512, 513, 4096)] == [
        0, 0, 1, 2, 2, 3, 4, 5, 9, 9, 9,
    ]  # fmt: skip
    assert ROW_BUCKETS[bucket_index(100)] == 128


def test_choose_keeps_the_own_kernel_unless_another_is_clearly_faster():
    assert choose({"own": 1.0, "torch": 0.95}, "own") == "own"  # within the margin
    assert choose({"own": 1.0, "torch": 0.5}, "own") == "torch"
    assert choose({"own": 1.0, "a": 0.5, "b": 0.4}, "own") == "b"
    assert choose({"own": 0.3, "a": 0.5}, "own") == "own"


def _timings(torch_s_by_rows: dict[int, float]) -> dict:
    return {str(r): {"own": 1.0, "torch": t} for r, t in torch_s_by_rows.items()}


def test_one_crossover_from_the_timings():
    fast_from_64 = _timings({r: (0.5 if r >= 64 else 2.0) for r in ROW_BUCKETS})
    assert table_choices(fast_from_64, "own", ["own", "torch"]) == ("own",) * 6 + ("torch",) * 4
    # a noisy win at 4 rows below a loss at 8 does not switch the kernel there
    noisy = _timings({r: (0.5 if r == 4 or r >= 128 else 2.0) for r in ROW_BUCKETS})
    assert table_choices(noisy, "own", ["own", "torch"]) == ("own",) * 7 + ("torch",) * 3
    # a loss at the largest bucket: no crossover at all
    late_loss = _timings({r: (0.5 if r < 512 else 2.0) for r in ROW_BUCKETS})
    assert table_choices(late_loss, "own", ["own", "torch"]) == ("own",) * 10
    # the floor (rows a fused decode step takes) keeps the own kernel below it
    always = _timings(dict.fromkeys(ROW_BUCKETS, 0.5))
    assert table_choices(always, "own", ["own", "torch"], floor=7) == ("own",) * 7 + ("torch",) * 3
    # timed up to 32 rows (the next call was too slow): the larger buckets take 32's choice
    short = _timings({1: 2.0, 2: 2.0, 4: 0.5, 8: 0.5, 16: 0.5, 32: 0.5})
    assert table_choices(short, "own", ["own", "torch"]) == ("own",) * 2 + ("torch",) * 8
    # timed up to 64 rows with the own kernel ahead there: the fixed rule above
    slow_head = _timings({r: 2.0 for r in ROW_BUCKETS[:7]})
    assert table_choices(slow_head, "own", ["own", "torch"]) == ("own",) * 7 + (None,) * 3
    assert table_choices({}, "own", ["own", "torch"]) == (None,) * 10


def test_an_unknown_kernel_choice_is_a_typed_error():
    assert EngineArgs(model="kvserve-demo").kernel_choice == "measured" == KERNEL_CHOICES[0]
    with pytest.raises(InvalidRequestError, match="kernel_choice"):
        EngineArgs(model="kvserve-demo", kernel_choice="fastest").create_engine_config()


# --- every candidate against the oracle --------------------------------------------------------------


def _fp32_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """|fp32 GEMM - exact| <= (K + 2) u sum_k |x_k w_k| (+ |b|), any summation order; factor 2."""
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return 2 * (weight.shape[1] + 2) * 2.0**-24 * magnitude


@needs_panels
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_fp32_candidate_matches_the_oracle(with_bias):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 70, generator=gen)  # 40 outputs: the last panel is padded
    bias = torch.randn(40, generator=gen) if with_bias else None
    module = PackedLinear(weight, bias)
    cands = candidates_of(module)
    assert cands.own == "panel-f32" and set(cands.builders) <= {"onednn-f32", "torch-f32"}
    assert "torch-f32" in cands.builders and cands.key == "40x70/f32"
    for rows in (1, 3, 130):
        x = torch.randn(rows, 70, generator=gen)
        want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        for name, build in cands.builders.items():
            run, extra_bytes = build()
            assert extra_bytes == 40 * 70 * 4
            assert ((run(x).double() - want).abs() <= _fp32_bound(x, weight, bias)).all(), name
        assert ((module(x).double() - want).abs() <= _fp32_bound(x, weight, bias)).all()


@needs_panels
def test_the_bf16_candidate_is_bf16_products(monkeypatch):
    """torch's bf16 GEMM (oneDNN; AMX where the probe finds it) takes the bf16 products' weights:
    it is offered only where bf16 runs in hardware (not on this project's Zen 3), so it is forced
    here to check its numbers against bf16(x) bf16(W)^T in fp64, rounded once to bf16."""
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(24, 64, generator=gen), torch.randn(24, generator=gen)
    module = PackedLinear(weight, bias, bf16_products=True)
    monkeypatch.setattr(kernel_table, "torch_bf16_gemm", lambda: False)
    assert candidates_of(module).builders == {}  # no hardware bf16: own kernel only
    monkeypatch.setattr(kernel_table, "torch_bf16_gemm", lambda: True)
    cands = candidates_of(module)
    assert cands.own == "bf16dot" and list(cands.builders) == ["onednn-bf16"]
    run, extra_bytes = cands.builders["onednn-bf16"]()
    assert extra_bytes == 24 * 64 * 2
    x = torch.randn(9, 64, generator=gen)
    exact = x.bfloat16().double() @ weight.bfloat16().double().T  # [9, 24]
    got = run(x).double() - bias.double()
    # each output rounded to bf16 (2^-8 relative) after fp32 sums
    assert ((got - exact).abs() <= 2.0**-8 * exact.abs() + 1e-3).all()
    assert ((module(x).double() - bias.double() - exact).abs() <= 1e-3 * (1 + exact.abs())).all()


def _block_layer(dequant_min_rows: int = 16) -> tuple[BlockLinear, torch.Tensor]:
    parts = [
        repack(quantized_blocks(t, rows, 256, seed=i), t, (rows, 256))
        for i, (t, rows) in enumerate((("Q4_1", 40), ("Q8_0", 24)))
    ]
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5))
    return BlockLinear(parts, bias, dequant_min_rows), torch.cat([p.dequantize() for p in parts])


@pytest.mark.skipif(not block_linear.native_available(), reason="no C kernels")
def test_the_block_candidates_match_the_oracle():
    layer, weight = _block_layer()
    cands = candidates_of(layer)
    assert cands.key == "64x256/Q4_1,Q8_0" and cands.own == "blocks"
    assert [cands.rule(r) for r in (8, 15, 16, 512)] == ["blocks"] * 2 + ["dequant-matmul"] * 2
    run, extra_bytes = cands.builders["dequant-matmul"]()
    assert extra_bytes == 0  # chunks of rows, no resident copy
    for rows in (1, 20):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        want = F.linear(x.double(), weight.double(), layer.bias.double())
        bound = _fp32_bound(x, weight, layer.bias) + 1e-5
        for got in (run(x), layer.forward_rule(x, True), layer.forward_rule(x, False), layer(x)):
            assert ((got.double() - want).abs() <= bound).all()


# --- modes, cache and what is shown ------------------------------------------------------------------


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path / "kernel-table"


@needs_panels
def test_own_changes_nothing_and_torch_takes_torch_where_valid(cache_root):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 32, generator=gen)
    model = nn.Sequential(PackedLinear(weight, None))
    x = torch.randn(200, 32, generator=gen)
    before = model(x)
    assert apply_kernel_choice(model, "own") == {} and model[0].row_kernels is None
    assert torch.equal(model(x), before) and not cache_root.exists()
    table = apply_kernel_choice(model, "torch")
    floor = bucket_index(fused_decode.max_step_rows()) + 1
    assert list(table["48x32/f32"].values()) == ["panel-f32"] * floor + ["onednn-f32"] * (
        10 - floor
    )
    assert torch.equal(model(x[:1]), before[:1])  # below the floor: the panels, bit for bit
    want = F.linear(x.double(), weight.double())
    assert ((model(x).double() - want).abs() <= _fp32_bound(x, weight, None)).all()


@pytest.mark.skipif(not block_linear.native_available(), reason="no C kernels")
def test_measured_timings_are_cached_and_an_empty_budget_keeps_the_rule(cache_root):
    layer, _ = _block_layer()
    model = nn.Sequential(layer)
    ruled = apply_kernel_choice(model, "measured", budget_s=0.0)
    assert ruled == {
        "64x256/Q4_1,Q8_0": {
            str(r): ("blocks (rule)" if r < 16 else "dequant-matmul (rule)") for r in ROW_BUCKETS
        }
    }
    assert layer.row_kernels == (None,) * 10 and not cache_root.exists()
    measured = apply_kernel_choice(model, "measured", budget_s=30.0)
    (path,) = cache_root.iterdir()
    timings = json.loads(path.read_text())["64x256/Q4_1,Q8_0"]
    assert set(timings["1"]) == {"blocks", "dequant-matmul"}
    kernels = list(measured["64x256/Q4_1,Q8_0"].values())
    assert set(kernels) <= {"blocks", "dequant-matmul"}
    assert layer.row_kernels == tuple(k == "blocks" for k in kernels)
    # the cache answers without a budget; remeasure ignores it
    assert apply_kernel_choice(model, "measured", budget_s=0.0) == measured
    assert "(rule)" in str(apply_kernel_choice(model, "remeasure", budget_s=0.0))


def test_the_engine_reports_the_choice_and_the_manifest_shows_it(cache_root):
    llm = LLM("kvserve-demo", num_blocks=32, kernel_choice="torch")
    info = engine_info(llm.engine)
    assert info.matrix_engine == probe_matrix_engine().label
    model = llm.engine.runner.model
    assert info.kernel_table == model.kernel_table
    if fused_decode.max_rows():
        shapes = {k for k in info.kernel_table if k.endswith("/f32")}
        assert shapes and all(info.kernel_table[s]["512"] == "onednn-f32" for s in shapes)
    manifest = build_manifest(
        info.model_dir, served_model_name="m", dtype=info.dtype, chat_template=None,
        engine_options={}, matrix_engine=info.matrix_engine, kernel_table=info.kernel_table,
    )  # fmt: skip
    assert manifest["kernels"] == {"matrix_engine": info.matrix_engine, "table": info.kernel_table}
    banner = startup_summary(info, "m", "http://127.0.0.1:1")
    assert f"  matrix     {info.matrix_engine}" in banner
    assert all(f"  gemm       {shape}  " in banner for shape in info.kernel_table)
    own = engine_info(LLM("kvserve-demo", num_blocks=32, kernel_choice="own").engine)
    assert own.kernel_table == {} and own.matrix_engine == info.matrix_engine


def test_runs_of_equal_choices_are_written_as_ranges():
    from kvserve.core.runs import compact_runs

    assert compact_runs({}) == ""
    assert compact_runs({"1": "panel"}) == "1 panel"
    per_bucket = {"1": "panel", "2": "panel", "64": "panel", "128": "onednn", "256": "panel"}
    assert compact_runs(per_bucket) == "1-64 panel, 128 onednn, 256 panel"
