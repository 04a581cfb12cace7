"""Pre-quantised GPTQ and AWQ checkpoints (kvserve/quant/hf_checkpoints.py).

The oracles: AutoAWQ's own dequantisation and its AWQ -> GPTQ (exllama) repacking (its pure-torch
`awq/utils/packing_utils.py`, when the package is installed: `make install` puts it in with
--no-deps), and the same int4 codes served from memory (`LLM(..., quantization=...)` rounds the
float checkpoint to exactly the codes these files are packed from, so the logits must be equal)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.core.errors import ModelLoadError
from kvserve.engine.llm import LLM
from kvserve.quant.hf_checkpoints import AWQ_ORDER, _awq_columns, _nibbles, hf_quantized_tensors
from kvserve.quant.rtn import quantize
from kvserve.quant.scheme import parse_tensor_scheme
from kvserve.server.manifest import quantization_manifest
from tests.checkpoints import build_checkpoint

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
PREFIX = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("hfq_src") / "llama"
    hf = build_checkpoint(path, "llama", hidden_size=96, intermediate_size=160)
    return path, hf


def awq_reference():
    """AutoAWQ's packing_utils, loaded without the package's __init__ (which needs accelerate)."""
    spec = importlib.util.find_spec("awq")
    if spec is None:
        pytest.skip("autoawq is not installed (make install adds it with --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] nibbles -> int32 [rows / 8, cols]: row 8w + j at bits 4j (GPTQ's qweight)."""
    grouped = codes.to(torch.int64).reshape(codes.shape[0] // 8, 8, codes.shape[1])
    shifts = (torch.arange(8, dtype=torch.int64) * 4).view(1, 8, 1)
    return (grouped << shifts).sum(dim=1).to(torch.int32)


def pack_cols(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[rows, cols] nibbles -> int32 [rows, cols / 8]: bits 4j hold column 8w + order[j]."""
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, 8)[:, :, list(order)]
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return (grouped << shifts).sum(dim=2).to(torch.int32)


def packed_entries(weight: torch.Tensor, scheme: str, layout: str) -> dict[str, torch.Tensor]:
    """One linear's GPTQ (`gptq` v1 or `gptq_v2`) or AWQ entries, packed from kvserve's RTN codes."""
    qt = quantize(weight, parse_tensor_scheme(scheme))
    if qt.zeros is None:  # symmetric: GPTQ's sym codes are q + 8 around a zero-point of 8
        codes, zeros = qt.codes.to(torch.int16) + 8, torch.full_like(qt.scales, 8)
    else:
        codes, zeros = qt.codes.to(torch.int16), qt.zeros
    codes_t, zeros_t = codes.t(), zeros.to(torch.int16).t()  # [in, out], [groups, out]
    scales = qt.scales.t().contiguous()
    if layout == "awq":
        return {
            "qweight": pack_cols(codes_t, AWQ_ORDER),
            "qzeros": pack_cols(zeros_t, AWQ_ORDER),
            "scales": scales,
        }
    stored_zeros = (zeros_t - 1) & 0xF if layout == "gptq" else zeros_t
    return {
        "qweight": pack_rows(codes_t),
        "qzeros": pack_cols(stored_zeros),
        "scales": scales,
        "g_idx": torch.arange(weight.shape[1], dtype=torch.int32) // GROUP,
    }


def quant_config(layout: str, scheme: str) -> dict:
    if layout == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP,
            "zero_point": True,
            "version": "gemm",
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": not scheme.endswith("-zp"),
        "checkpoint_format": layout,
    }


def write_quantized(src: Path, out: Path, layout: str, scheme: str, edit=None) -> Path:
    """A copy of `src` whose block linears are packed as `layout`; `edit(tensors, config)` may
    break it."""
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    for name in [k for k in tensors if k.rsplit(".", 2)[-2] in LINEARS]:
        prefix = name[: -len(".weight")]
        weight = tensors.pop(name)
        for key, value in packed_entries(weight, scheme, layout).items():
            tensors[f"{prefix}.{key}"] = value.contiguous()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config(layout, scheme)
    if edit is not None:
        edit(tensors, config)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def read_one(layout: str, scheme: str, weight: torch.Tensor) -> torch.Tensor:
    entries = {f"{PREFIX}.{k}": v for k, v in packed_entries(weight, scheme, layout).items()}
    qts = hf_quantized_tensors(quant_config(layout, scheme), entries, "test")
    return qts[f"{PREFIX}.weight"].dequantize()


WORD = 0x87654321 - 2**32  # nibble j (bits 4j) holds j + 1, as a signed int32


def test_known_words_unpack_to_known_values():
    """Hand-made words, independent of the packers below: GPTQ reads nibble j as row / column
    8w + j; AWQ's nibble j is column 8w + (0, 2, 4, 6, 1, 3, 5, 7)[j] (AutoAWQ's order_map)."""
    word = torch.tensor([[WORD]], dtype=torch.int32)
    assert _nibbles(word).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert _awq_columns(word).tolist() == [[1, 5, 2, 6, 3, 7, 4, 8]]
    # a whole GPTQ v1 linear, 32 inputs x 8 outputs in one group: qweight column 0 holds inputs
    # 0..7 = 1..8 in its first word; qzeros 0x77777777 is a zero of 8 everywhere (symmetric)
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qweight[0, 0] = WORD
    entries = {
        "l.qweight": qweight,
        "l.qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
        "l.scales": torch.full((1, 8), 0.5, dtype=torch.float16),
    }
    qt = hf_quantized_tensors(quant_config("gptq", "int4-g32"), entries, "t")["l.weight"]
    assert qt.zeros is None and qt.scheme.name == "int4"  # one group of the whole row
    assert qt.codes[0, :8].tolist() == [c - 8 for c in range(1, 9)]
    assert qt.dequantize()[0, :8].tolist() == [0.5 * (c - 8) for c in range(1, 9)]
    assert (qt.codes[1:] == -8).all() and (qt.codes[0, 8:] == -8).all()


def test_gptq_v1_stored_15_is_a_zero_of_16():
    """v1 stores zero - 1: a stored 15 is zero 16 (as AutoGPTQ, exllama and vLLM compute it), not 0."""
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qweight[0, 0] = WORD
    entries = {
        "l.qweight": qweight,
        "l.qzeros": torch.tensor([[-1]], dtype=torch.int32),  # every nibble 15
        "l.scales": torch.full((1, 8), 0.5, dtype=torch.float16),
    }
    qt = hf_quantized_tensors(quant_config("gptq", "int4-g32-zp"), entries, "t")["l.weight"]
    assert qt.dequantize()[0, :8].tolist() == [0.5 * (c - 16) for c in range(1, 9)]


def test_gptq_output_width_not_a_multiple_of_8():
    """12 outputs: qzeros carry a padded second word; its padding nibbles are not zero-points."""
    entries = {
        "l.qweight": torch.full((4, 12), 0x88888888 - 2**32, dtype=torch.int32),  # codes 8
        "l.qzeros": torch.tensor([[0x77777777, 0x00007777]], dtype=torch.int32),  # zero 8 (v1)
        "l.scales": torch.full((1, 12), 0.25, dtype=torch.float16),
    }
    qt = hf_quantized_tensors(quant_config("gptq", "int4-g32"), entries, "t")["l.weight"]
    assert qt.zeros is None and qt.codes.shape == (12, 32)  # symmetric: every real zero is 8
    assert torch.equal(qt.dequantize(), torch.zeros(12, 32))


@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g32-zp"])
def test_reader_recovers_the_packed_codes(source, layout, scheme):
    """Packed from kvserve's RTN codes, read back to exactly the same dequantised weight."""
    _, hf = source
    weight = hf.state_dict()[f"{PREFIX}.weight"]
    expected = quantize(weight, parse_tensor_scheme(scheme)).dequantize()
    assert torch.equal(read_one(layout, scheme, weight), expected)


def test_awq_reader_matches_autoawq(source):
    ref = awq_reference()
    _, hf = source
    weight = hf.state_dict()[f"{PREFIX}.weight"]
    e = packed_entries(weight, "int4-g32-zp", "awq")
    theirs = ref.dequantize_gemm(e["qweight"], e["qzeros"], e["scales"], 4, GROUP).t().float()
    # AutoAWQ multiplies in fp16: equal to fp16 rounding of ours
    torch.testing.assert_close(read_one("awq", "int4-g32-zp", weight), theirs, rtol=1e-3, atol=1e-6)


def test_gptq_reader_reads_autoawq_repacked_awq(source):
    """AutoAWQ's AWQ -> GPTQ/exllama repacking (qweight along the input, zero - 1 in qzeros), read
    by the GPTQ reader, dequantises to AutoAWQ's own dequantisation of the AWQ original."""
    ref = awq_reference()
    _, hf = source
    weight = hf.state_dict()[f"{PREFIX}.weight"]
    awq = packed_entries(weight, "int4-g32-zp", "awq")
    qweight, qzeros = ref.unpack_reorder_pack(awq["qweight"], awq["qzeros"], 4)
    entries = {
        f"{PREFIX}.qweight": qweight,
        f"{PREFIX}.qzeros": qzeros,
        f"{PREFIX}.scales": awq["scales"],
    }
    ours = hf_quantized_tensors(quant_config("gptq", "int4-g32-zp"), entries, "t")
    theirs = ref.dequantize_gemm(awq["qweight"], awq["qzeros"], awq["scales"], 4, GROUP).t()
    torch.testing.assert_close(
        ours[f"{PREFIX}.weight"].dequantize(), theirs.float(), rtol=1e-3, atol=1e-6
    )


@pytest.mark.parametrize(
    ("layout", "scheme"),
    [("gptq", "int4-g32"), ("gptq_v2", "int4-g32-zp"), ("awq", "int4-g32-zp")],
)
def test_served_logits_equal_the_same_codes_in_memory(source, tmp_path, layout, scheme):
    src, _ = source
    out = write_quantized(src, tmp_path / layout, layout, scheme)
    served = LLM(str(out), num_blocks=16, max_model_len=64)
    in_memory = LLM(str(src), quantization=scheme, num_blocks=16, max_model_len=64)
    torch.testing.assert_close(
        served.engine.score(PROMPT), in_memory.engine.score(PROMPT), rtol=0, atol=0
    )
    manifest = quantization_manifest(out, None)
    method = layout.split("_")[0]
    assert manifest["method"] == method and manifest["source"] == "checkpoint"
    assert manifest["scheme"] == f"{method} {scheme}"


def _permute_g_idx(tensors, config):
    for key in [k for k in tensors if k.endswith(".g_idx")]:
        tensors[key] = tensors[key].flip(0).contiguous()


def _bits(n):
    return lambda tensors, config: config["quantization_config"].update(bits=n)


def _awq_version(tensors, config):
    config["quantization_config"]["version"] = "gemv"


def _bad_scales(tensors, config):
    tensors[f"{PREFIX}.scales"] = tensors[f"{PREFIX}.scales"][:-1].contiguous()


def _no_g_idx_with_desc_act(tensors, config):
    config["quantization_config"]["desc_act"] = True
    for key in [k for k in tensors if k.endswith(".g_idx")]:
        del tensors[key]


@pytest.mark.parametrize(
    ("layout", "edit", "message"),
    [
        ("gptq", _permute_g_idx, "act-order .*contiguous groups"),
        ("gptq", _bits(8), "unsupported gptq quantization_config .*8-bit"),
        ("awq", _awq_version, "AWQ version 'gemv'"),
        ("gptq", _bad_scales, "down_proj.scales has shape"),
        ("gptq", _no_g_idx_with_desc_act, "desc_act without a g_idx"),
    ],
)
def test_unsupported_checkpoints_are_named(source, tmp_path, layout, edit, message):
    src, _ = source
    out = write_quantized(src, tmp_path / "q", layout, "int4-g32-zp", edit)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(out), num_blocks=16, max_model_len=64)
