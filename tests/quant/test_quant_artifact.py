"""A written quantised checkpoint round-trips: the compressed-tensors library's own decompression and
kvserve's loader give the same weights as the in-memory quantisation, and serving the artifact gives
the same logits as quantising at load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kvserve.core.errors import ModelLoadError
from kvserve.engine.llm import LLM
from kvserve.quant.convert import REPORT_NAME
from kvserve.quant.pipeline import quantize_checkpoint
from kvserve.quant.provenance import artifact_sha256
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import QuantizationError, parse_weight_scheme
from tests.checkpoints import build_checkpoint

ct = pytest.importorskip("compressed_tensors")
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5]
SCHEMES = [
    "int8",
    "int4-g32",
    "int4-g32-zp",
    "int4-zp",
    "int4-pt",
    "w8a8",
    "linear=int4-g32,head=int4",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct_src") / "llama"
    hf = build_checkpoint(path, "llama", hidden_size=96, intermediate_size=160)
    return path, hf


def library_decompress(out_dir, prefix: str) -> torch.Tensor:
    """compressed-tensors' decompression of one linear, from its config group."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qconfig = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    group = qconfig["config_groups"]["group_1" if prefix == "lm_head" else "group_0"]
    scheme = QuantizationScheme(
        targets=group["targets"],
        weights=group["weights"],
        input_activations=group["input_activations"],
    )
    compressor = BaseCompressor.get_value_from_registry(qconfig["format"])
    tensors = load_file(str(out_dir / "model.safetensors"))
    local = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    return compressor.decompress(local, scheme)["weight"].float()


@pytest.mark.parametrize("weights", SCHEMES)
def test_artifact_round_trips_through_compressed_tensors_and_serving(source, tmp_path, weights):
    src, hf = source
    out = tmp_path / "q"
    report = quantize_checkpoint(src, out, weights=weights, method="rtn")
    assert report["artifact_sha256"] == artifact_sha256(out)
    assert json.loads((out / REPORT_NAME).read_text())["scheme"] == weights
    scheme = parse_weight_scheme(weights)
    state = hf.state_dict()
    prefixes = ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]
    if scheme.for_class("head") is not None:
        prefixes.append("lm_head")
    for prefix in prefixes:
        cls = "head" if prefix == "lm_head" else "linear"
        expected = quantize(state[f"{prefix}.weight"], scheme.for_class(cls)).dequantize()
        # compressed-tensors computes in the fp16 scale's dtype: equal to fp16 rounding
        torch.testing.assert_close(library_decompress(out, prefix), expected, rtol=1e-3, atol=1e-6)
    served = LLM(str(out), num_blocks=16, max_model_len=64)
    at_load = LLM(str(src), quantization=weights, num_blocks=16, max_model_len=64)
    torch.testing.assert_close(
        served.engine.score(PROMPT), at_load.engine.score(PROMPT), rtol=0, atol=0
    )


def test_artifact_errors(source, tmp_path):
    src, _ = source
    with pytest.raises(QuantizationError, match="embedding"):
        quantize_checkpoint(src, tmp_path / "a", weights="linear=int8,embed=int8")
    with pytest.raises(QuantizationError, match="smoothquant needs quantised activations"):
        quantize_checkpoint(src, tmp_path / "a", weights="int4-g128", method="smoothquant")
    with pytest.raises(QuantizationError, match="weight-only"):
        quantize_checkpoint(src, tmp_path / "a", weights="w8a8", method="gptq")
    with pytest.raises(QuantizationError, match="needs calibration text"):
        quantize_checkpoint(src, tmp_path / "a", weights="int4-g128", method="gptq")
    with pytest.raises(QuantizationError, match="does not exist"):
        quantize_checkpoint(
            src, tmp_path / "a", weights="int4-g128", method="gptq", calib="/nonexistent.txt"
        )
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(QuantizationError, match="is empty"):
        quantize_checkpoint(src, tmp_path / "a", weights="int4-g128", method="gptq", calib=empty)
    with pytest.raises(QuantizationError, match="inputs, not a multiple of int4-g64"):
        quantize_checkpoint(src, tmp_path / "a", weights="int4-g64")  # hidden 96
    out = tmp_path / "q"
    quantize_checkpoint(src, out, weights="int8")
    with pytest.raises(QuantizationError, match="already quantised"):
        LLM(str(out), quantization="int8", num_blocks=16)


def test_unsupported_quantization_config_is_named(source, tmp_path):
    src, _ = source
    out = tmp_path / "q"
    quantize_checkpoint(src, out, weights="int4-g32")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported quantization_config .*3-bit"):
        LLM(str(out), num_blocks=16)
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method 'bitsandbytes'"):
        LLM(str(out), num_blocks=16)
