"""Calibrated methods: SmoothQuant is an exact identity before rounding; GPTQ and AWQ lower the
layer-wise objective ||X W^T - X W_hat^T|| below round-to-nearest's on the same layer; GPTQ calibrates
each linear on the inputs the quantised linears before it produce."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.quant import calibrated
from kvserve.quant.calibrated import (
    _GROUPS,
    _SEQUENTIAL,
    Stats,
    awq_clip,
    awq_scales,
    calibrated_quantize,
    collect_stats,
    fold,
    gptq,
    sequential_gptq,
    smooth_scales,
)
from kvserve.quant.convert import REPORT_NAME
from kvserve.quant.pipeline import quantize_checkpoint
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import QuantizationError, parse_tensor_scheme, parse_weight_scheme
from tests.checkpoints import build_gpt2_tokenized_checkpoint

CALIB = "The quick brown fox jumps over the lazy dog. " * 40 + "def f(x):\n    return x * 2\n" * 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("methods") / "m"
    hf = build_gpt2_tokenized_checkpoint(path, hidden_size=64, intermediate_size=128)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(path)).encode(CALIB)
    return path, hf, ids


def test_smoothquant_folding_is_an_exact_identity(model):
    path, hf, ids = model
    stats = collect_stats(path, ids)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for group, (linears, _) in _GROUPS.items():
            weights = [state[f"{prefix}.{lin}.weight"] for lin in linears]
            s = smooth_scales(weights, stats[f"{prefix}.{linears[0]}"], alpha=0.8)
            assert (s - 1).abs().max() > 0.1  # the scales really move range
            fold(state, prefix, group, s)
    smoothed = type(hf)(hf.config).eval()
    smoothed.load_state_dict(state)
    x = torch.tensor([ids[:48]])
    with torch.no_grad():
        torch.testing.assert_close(smoothed(x).logits, hf(x).logits, rtol=0, atol=1e-5)


def layer_error(x, w, w_hat) -> float:
    return (x @ w.t() - x @ w_hat.t()).norm().item()


@pytest.mark.parametrize("name", ["int4-g32", "int4", "int4-g32-zp"])
def test_gptq_and_awq_lower_the_layer_objective_below_rtn(model, name):
    path, hf, ids = model
    stats = collect_stats(path, ids)
    scheme = parse_tensor_scheme(name)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = hf.get_submodule(module).weight.detach()
        st = stats[module]
        x = st.sample
        rtn = layer_error(x, w, quantize(w, scheme).dequantize())
        gptq_q = gptq(w, st.hessian, scheme)
        assert gptq_q.codes.abs().max() <= 15
        assert layer_error(x, w, gptq_q.dequantize()) < rtn
    # AWQ needs salient input channels, which a random-weight model's activations lack: give 4 of
    # 64 channels 20x the magnitude, as trained models' outlier channels have
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen)
    x[:, :4] *= 20
    w = torch.randn(96, 64, generator=gen) / 8
    st = Stats(64)
    st.add(x)
    rtn = layer_error(x, w, quantize(w, scheme).dequantize())
    s, alpha = awq_scales([w], st, scheme)
    assert alpha > 0
    assert layer_error(x, w, quantize(w * s, scheme).dequantize() / s) < rtn
    assert layer_error(x, w, gptq(w, st.hessian, scheme).dequantize()) < rtn


@pytest.mark.parametrize("name", ["int4-g32", "int4", "int4-g32-zp"])
def test_awq_clipping_lowers_the_error_of_weights_with_a_heavy_tail(name):
    """A few large weights stretch their groups' range; clamping them (the search keeps r = 1 where
    that is best) lowers every row's and group's error e H e^T, and the layer's."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=gen)
    w = torch.randn(96, 64, generator=gen) / 8
    w[torch.rand(96, 64, generator=gen) < 0.03] *= 6
    st = Stats(64)
    st.add(x)
    scheme = parse_tensor_scheme(name)
    clipped = awq_clip(w, st.hessian, scheme)
    assert (clipped != w).any()  # some range was clipped
    glen = scheme.group_len(64)

    def group_errors(w_hat):  # [groups, rows]: e H e^T over each group's inputs
        e = (w - w_hat).double()
        return torch.stack([
            ((e[:, c : c + glen] @ st.hessian[c : c + glen, c : c + glen]) * e[:, c : c + glen]).sum(1)
            for c in range(0, 64, glen)
        ])  # fmt: skip

    before = group_errors(quantize(w, scheme).dequantize())
    after = group_errors(quantize(clipped, scheme).dequantize())
    assert (after <= before * (1 + 1e-9)).all()
    assert after.sum() < 0.97 * before.sum()
    rtn = layer_error(x, w, quantize(w, scheme).dequantize())
    assert layer_error(x, w, quantize(clipped, scheme).dequantize()) < rtn


@pytest.mark.parametrize("num_cols, block", [(64, 32), (80, 32), (96, 96), (40, 64)])
def test_block_hessian_is_the_whole_hessians_diagonal(num_cols, block):
    """Stats(hessian=g) keeps X^T X's g x g diagonal blocks (a short last one padded), as the whole
    matrix has them; awq_clip gives the same weights from either."""
    gen = torch.Generator().manual_seed(2)
    whole, blocks = Stats(num_cols), Stats(num_cols, hessian=block, keep_rows=False)
    for _ in range(3):
        x = torch.randn(1, 50, num_cols, generator=gen)
        whole.add(x)
        blocks.add(x)
    assert blocks.rows == [] and whole.sample.shape == (150, num_cols)
    if block >= num_cols:
        assert blocks.hessian.shape == (num_cols, num_cols)
    for c0 in range(0, num_cols, block):
        c1 = min(c0 + block, num_cols)
        torch.testing.assert_close(
            calibrated.hessian_block(blocks.hessian, c0, c1), whole.hessian[c0:c1, c0:c1]
        )
    s = torch.rand(num_cols, generator=gen) + 0.5
    for c0 in range(0, num_cols, block):
        c1 = min(c0 + block, num_cols)
        torch.testing.assert_close(
            calibrated.hessian_block(calibrated.divided_by_scales(blocks.hessian, s), c0, c1),
            calibrated.divided_by_scales(whole.hessian, s)[c0:c1, c0:c1],
        )
    w = torch.randn(24, num_cols, generator=gen)
    w[torch.rand(24, num_cols, generator=gen) < 0.05] *= 6
    scheme = parse_tensor_scheme(f"int4-g{block}" if block < num_cols else "int4")
    assert torch.equal(awq_clip(w, blocks.hessian, scheme), awq_clip(w, whole.hessian, scheme))
    with pytest.raises(ValueError, match="no input rows"):
        _ = blocks.sample


@pytest.mark.parametrize(
    "method, weights",
    [("awq", "linear=int4-g32"), ("awq", "linear=int4-pt"), ("smoothquant", "w8a8")],
)
def test_one_float_pass_keeps_only_what_the_method_reads(model, method, weights, monkeypatch):
    """AWQ keeps its scale groups' Hessian blocks for the linears it clips and input rows for each
    input group's first linear; SmoothQuant only the channel maxima. The codes equal those made
    from every statistic in full (a 7B Llama's whole Hessians would take ~57 GB)."""
    path, hf, ids = model
    checkpoint = {k: v.clone() for k, v in hf.state_dict().items()}
    scheme = parse_weight_scheme(weights)
    kept = {}
    real = calibrated.collect_stats

    def spy(*args, **kwargs):
        kept.update(real(*args, **kwargs))
        return kept

    monkeypatch.setattr(calibrated, "collect_stats", spy)
    lean, _, _ = calibrated_quantize(path, checkpoint, scheme, method, ids)
    sizes = {name.split(".", 3)[3]: (st.hessian.shape, bool(st.rows)) for name, st in kept.items()}
    if weights == "linear=int4-pt":  # one scale per tensor: nothing to clip, rows for the scales
        assert all(shape == (0,) for shape, _ in sizes.values())
        assert sizes["mlp.gate_proj"][1] and not sizes["mlp.up_proj"][1]
    elif method == "awq":  # hidden 64, intermediate 128
        assert sizes["self_attn.q_proj"] == ((0,), True)
        assert sizes["self_attn.k_proj"] == ((0,), False)
        assert sizes["self_attn.v_proj"] == ((2, 32, 32), False)
        assert sizes["mlp.gate_proj"] == ((2, 32, 32), True)
        assert sizes["mlp.down_proj"] == ((4, 32, 32), True)
    else:
        assert all(shape == (0,) and not rows for shape, rows in sizes.values())
    monkeypatch.setattr(calibrated, "_stats_needed", lambda *a, **k: (0, True))
    full, _, _ = calibrated_quantize(path, checkpoint, scheme, method, ids)
    assert lean.keys() == full.keys()
    for name in full:
        assert torch.equal(lean[name].codes, full[name].codes), name
        assert torch.equal(lean[name].scales, full[name].scales), name


def test_awq_with_a_short_last_group_equals_full_statistics(tmp_path, monkeypatch):
    """At load a row may end in a short group (192 inputs at g128: 128 + 64): its Hessian block is
    the padded last one, and its input scales are padded too; the codes equal those from the whole
    Hessians."""
    path = tmp_path / "m"
    hf = build_gpt2_tokenized_checkpoint(path, hidden_size=64, intermediate_size=192)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(path)).encode(CALIB)
    checkpoint = {k: v.clone() for k, v in hf.state_dict().items()}
    scheme = parse_weight_scheme("linear=int4-g128")
    lean, _, _ = calibrated_quantize(path, checkpoint, scheme, "awq", ids, whole_groups=False)
    monkeypatch.setattr(calibrated, "_stats_needed", lambda *a, **k: (0, True))
    full, _, _ = calibrated_quantize(path, checkpoint, scheme, "awq", ids, whole_groups=False)
    down = "model.layers.0.mlp.down_proj.weight"
    assert full[down].scales.shape[1] == 2  # 128 + 64
    for name in full:
        assert torch.equal(lean[name].codes, full[name].codes), name
        assert torch.equal(lean[name].scales, full[name].scales), name


def test_gptq_calibrates_each_linear_on_the_quantised_linears_before_it(model, monkeypatch):
    """The oracle: a full forward of the float model in which every linear GPTQ quantised before the
    one checked (layer 0's, then layer 1's q/k/v, o, gate/up) holds its dequantised weights. The
    checked linear's inputs there give the Hessian it was quantised with; the float model's do not."""
    path, hf, ids = model
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    scheme = parse_tensor_scheme("int4-g32")
    formats = {k: scheme for k in state if ".layers." in k and k.endswith("_proj.weight")}
    layers = hf.config.num_hidden_layers
    target = f"model.layers.{layers - 1}.mlp.down_proj"
    used = {}

    def recording_gptq(weight, hessian, scheme):
        if weight is state[target + ".weight"]:
            used["hessian"] = hessian.clone()
        return gptq(weight, hessian, scheme)

    monkeypatch.setattr("kvserve.quant.calibrated.gptq", recording_gptq)
    quantized, stats = sequential_gptq(path, state, formats, ids, chunk=64)
    assert set(quantized) == set(formats)
    order = [f"model.layers.{i}.{n}" for i in range(layers) for group in _SEQUENTIAL for n in group]
    oracle = type(hf)(hf.config).eval()
    oracle.load_state_dict(state)
    for module in order[: order.index(target)]:
        oracle.get_submodule(module).weight.data = quantized[module + ".weight"].dequantize()
    seen = Stats(hf.config.intermediate_size)
    oracle.get_submodule(target).register_forward_hook(lambda m, a, o: seen.add(a[0]))
    with torch.no_grad():
        for start in range(0, len(ids), 64):
            oracle(torch.tensor([ids[start : start + 64]]), use_cache=False)
    used = used["hessian"]
    assert seen.count == stats[target].count == len(ids)
    assert stats[target].hessian.numel() == 0  # dropped once used: one group's held at a time
    torch.testing.assert_close(used, seen.hessian, rtol=1e-6, atol=1e-6 * seen.hessian.abs().max())
    floats = collect_stats(path, ids, chunk=64)[target].hessian
    assert (floats - used).norm() > 1e-3 * used.norm()  # the quantised inputs really differ


def test_calibrated_artifacts_load_and_report(model, tmp_path):
    path, _, _ = model
    calib = tmp_path / "calib.jsonl"
    calib.write_text(json.dumps({"text": CALIB}) + "\n")
    prompt = [50256, 464, 2068, 7586, 21831, 18045, 625, 262]
    ref = LLM(str(path), num_blocks=16, max_model_len=64).engine.score(prompt)
    for weights, method in (("int4-g32", "gptq"), ("int4-g32", "awq"), ("w8a8", "smoothquant")):
        out = tmp_path / method
        report = quantize_checkpoint(path, out, weights=weights, method=method, calib=str(calib))
        assert report["method"] == method and report["calibration"]["num_tokens"] >= 64
        assert "layers.0.mlp.down_proj" in report["outliers"]
        assert json.loads((out / REPORT_NAME).read_text())["artifact_sha256"]
        logits = LLM(str(out), num_blocks=16, max_model_len=64).engine.score(prompt)
        assert ((logits - ref).norm() / ref.norm()).item() < 0.5
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(QuantizationError, match="needs at least"):
        quantize_checkpoint(path, tmp_path / "x", weights="int4-g32", method="gptq", calib=short)


def test_calibrated_method_at_load_equals_its_artifact(model, tmp_path):
    """`--quantization FMT --quantization-method M --calib FILE` serves the codes `kvserve quantize`
    writes for the same text: the same logits as the artifact, bit for bit."""
    path, _, _ = model
    calib = tmp_path / "calib.jsonl"
    calib.write_text(json.dumps({"text": CALIB}) + "\n")
    prompt = [50256, 464, 2068, 7586, 21831, 18045, 625, 262]
    for weights, method in (("int4-g32", "gptq"), ("int4-g32", "awq"), ("w8a8", "smoothquant")):
        out = tmp_path / method
        quantize_checkpoint(path, out, weights=weights, method=method, calib=str(calib))
        served = LLM(str(out), num_blocks=16, max_model_len=64).engine.score(prompt)
        at_load = LLM(str(path), num_blocks=16, max_model_len=64, quantization=weights,
                      quantization_method=method, calib=str(calib)).engine.score(prompt)  # fmt: skip
        rtn = LLM(str(path), num_blocks=16, max_model_len=64, quantization=weights).engine.score(
            prompt
        )
        assert torch.equal(at_load, served), method
        assert not torch.equal(at_load, rtn), method  # the method did something


def test_calibrated_method_at_load_takes_a_short_last_group(tmp_path):
    """A row length that is not a multiple of the group: no artifact can hold it (compressed-tensors
    needs whole groups), but at load GPTQ quantises it with a short last group, and beats RTN."""
    path = tmp_path / "m"
    build_gpt2_tokenized_checkpoint(path, hidden_size=64, intermediate_size=192)  # down: 128 + 64
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    with pytest.raises(QuantizationError, match="short group"):
        quantize_checkpoint(path, tmp_path / "x", weights="int4-g128", method="gptq", calib=calib)
    llm = LLM(str(path), num_blocks=16, max_model_len=64, quantization="int4-g128",
              quantization_method="gptq", calib=str(calib))  # fmt: skip
    down = llm.engine.runner.model.layers[0].mlp.down_proj
    assert down.in_features == 192 and down.scales.shape[1] == 2  # [panels, groups, 8]: 128 + 64
    prompt = [50256, 464, 2068, 7586, 21831, 18045, 625, 262]
    ref = LLM(str(path), num_blocks=16, max_model_len=64).engine.score(prompt)
    rtn = LLM(str(path), num_blocks=16, max_model_len=64, quantization="int4-g128").engine.score(
        prompt
    )
    err = {
        "gptq": ((llm.engine.score(prompt) - ref).norm() / ref.norm()).item(),
        "rtn": ((rtn - ref).norm() / ref.norm()).item(),
    }
    assert 0 < err["gptq"] < 0.5 and err["rtn"] > 0, err


@pytest.mark.parametrize(
    "options, match",
    [
        ({"quantization_method": "gptq", "calib": "c.txt"}, "needs --quantization"),
        ({"quantization": "int4-g32", "quantization_method": "gptq"}, "pass --calib"),
        ({"quantization": "w8a8", "quantization_method": "gptq", "calib": "c.txt"}, "weight-only"),
        ({"quantization": "int8", "quantization_method": "smoothquant", "calib": "c.txt"}, "w8a8"),
        ({"quantization": "int8", "calib": "c.txt"}, "round to nearest uses none"),
        (
            {
                "quantization": "int8",
                "quantization_method": "gptq",
                "calib": "c.txt",
                "tensor_parallel_size": 2,
            },
            "one rank",
        ),  # fmt: skip
    ],
)
def test_calibrated_method_at_load_errors_name_the_choice(model, options, match):
    from kvserve.engine.args import EngineArgs

    path, _, _ = model
    with pytest.raises(QuantizationError, match=match):
        EngineArgs(model=str(path), **options).create_engine_config()


def test_calibrated_method_at_load_refuses_a_missing_calibration_file(model, tmp_path):
    path, _, _ = model
    with pytest.raises(QuantizationError, match="does not exist"):
        LLM(str(path), num_blocks=16, max_model_len=64, quantization="int4-g32",
            quantization_method="gptq", calib=str(tmp_path / "absent.txt"))  # fmt: skip


def test_manifest_names_the_method_and_calibration_at_load(model, tmp_path):
    from kvserve.paths import sha256_file
    from kvserve.server.manifest import quantization_manifest

    path, _, _ = model
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    rtn = quantization_manifest(path, "int4-g32")
    assert rtn["source"] == "rtn at load" and "calibration_sha256" not in rtn
    gptq = quantization_manifest(path, "int4-g32", "gptq", str(calib))
    assert gptq["method"] == "gptq" and gptq["source"] == "gptq at load"
    assert gptq["calibration_sha256"] == sha256_file(calib)
