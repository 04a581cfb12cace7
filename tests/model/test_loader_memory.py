"""Loading keeps no second reference to the checkpoint's tensors while the CPU layouts are built.

The CPU layouts (oneDNN's packed copy, the fp32 panels) are built one linear at a time; each original
weight can then be freed as its layer is converted, so the peak holds one model plus one layer's
copies, not the checkpoint, the packed copies and the panels of the whole model at once (a +28 GB
peak for a 7B fp32 model before this was fixed)."""

import gc
import os

import pytest
import torch

from kvserve import LLM
from kvserve.model import decoder
from tests.checkpoints import build_checkpoint


def test_no_tensor_outside_the_model_shares_a_weight_when_the_cpu_layouts_are_built(
    tmp_path, monkeypatch
):
    build_checkpoint(tmp_path, num_hidden_layers=2)
    seen = {}
    convert = decoder.DecoderLM.use_cpu_weights

    def spy(self):
        params = {id(p) for p in self.layers.parameters()}  # the block linears and norms
        ptrs = {p.untyped_storage().data_ptr() for p in self.layers.parameters()}
        gc.collect()
        seen["others"] = sum(
            1
            for t in gc.get_objects()
            if isinstance(t, torch.Tensor)
            and id(t) not in params
            and t.device.type == "cpu"
            and t.numel() > 0
            and t.untyped_storage().data_ptr() in ptrs
        )
        seen["params"] = len(params)
        convert(self)

    monkeypatch.setattr(decoder.DecoderLM, "use_cpu_weights", spy)
    LLM(str(tmp_path), kv_cache_memory_bytes=8 << 20)
    assert seen["params"] > 0
    assert seen["others"] == 0


def test_a_tied_fp32_table_is_served_from_the_head_panels_and_not_kept_twice(tmp_path):
    from kvserve.model import fused_decode
    from kvserve.model.linear import PanelEmbedding

    # 77 rows: the last panel is padded (77 = 4 x 16 + 13)
    hf = build_checkpoint(tmp_path, "llama_tied", vocab_size=77, num_hidden_layers=2)
    table = hf.model.embed_tokens.weight.detach()  # [77, hidden]
    model = LLM(str(tmp_path), kv_cache_memory_bytes=8 << 20).engine.runner.model
    if fused_decode.max_rows() == 0:  # no native kernels here: no panels, the table stays
        assert isinstance(model.embed_tokens, torch.nn.Embedding)
        return
    assert isinstance(model.embed_tokens, PanelEmbedding)
    assert model.embed_tokens.panels is model.cpu_head.panels  # one tensor, shared
    ids = torch.tensor([0, 15, 16, 63, 64, 76, 5, 5])
    assert torch.equal(model.embed_tokens(ids), table[ids])
    for bad in (77, 79, -1):  # a padded column, and a negative id, are refused as nn.Embedding does
        with pytest.raises(IndexError):
            model.embed_tokens(torch.tensor([3, bad]))
    gc.collect()
    copies = [
        t
        for t in gc.get_objects()
        if isinstance(t, torch.Tensor)
        and t.shape == table.shape
        and not t.is_mkldnn
        and t.untyped_storage().data_ptr() != table.untyped_storage().data_ptr()
    ]  # (oneDNN's opaque copy of the head is the head's, and stays)
    assert copies == []  # the engine holds no strided [vocab, hidden] table of its own


@pytest.mark.parametrize("layout", ["compressed-tensors", "gptq"])
def test_a_quantised_checkpoint_loads_without_an_fp32_copy_of_its_linears(
    tmp_path, monkeypatch, layout
):
    """The loader builds each integer linear from its codes; it used to dequantise every linear to
    fp32 first (a 28 GB peak for an int4 7B model, whose codes take 3.5 GB)."""
    from kvserve.model import fused_decode
    from kvserve.quant.kernels import kernels_available
    from kvserve.quant.pipeline import quantize_checkpoint
    from kvserve.quant.rtn import QuantizedTensor
    from tests.quant.test_quant_hf_checkpoints import write_quantized

    src = tmp_path / "src"
    build_checkpoint(src, "llama", hidden_size=96, intermediate_size=160, num_hidden_layers=2)
    if layout == "gptq":
        out = write_quantized(src, tmp_path / "q", "gptq", "int4-g32")
    else:
        out = tmp_path / "q"
        quantize_checkpoint(src, out, weights="linear=int4-g32,head=int4", method="rtn")
    calls = []
    dequantize = QuantizedTensor.dequantize

    def counted(self):
        calls.append(self.shape)
        return dequantize(self)

    monkeypatch.setattr(QuantizedTensor, "dequantize", counted)
    llm = LLM(str(out), num_blocks=16, max_model_len=64)
    kinds = {type(m).__name__ for m in llm.engine.runner.model.modules()}
    assert "QuantLinear" in kinds
    if fused_decode.max_rows() or kernels_available():  # else the stand-in kernel dequantises
        assert calls == []


def _maps_of(path) -> list[str]:
    return [line for line in open("/proc/self/maps") if str(path) in line]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("quantization", [None, "linear=int8,head=int8"])
def test_the_checkpoint_file_is_not_kept_mapped_once_loaded(tmp_path, quantization):
    """A norm left as a view of the memory-mapped safetensors file kept the whole mapping, and every
    page read from it while loading, resident (515 MB of RSS for a 540 MB fp32 checkpoint); with
    grad on, quantising at load also kept each fp32 weight alive through its scales' autograd
    graph. Both are gone: the model owns what it holds, and nothing in it records a graph."""
    build_checkpoint(tmp_path, "llama_tied", num_hidden_layers=2)
    files = list(tmp_path.glob("*.safetensors"))
    assert files
    llm = LLM(str(tmp_path), kv_cache_memory_bytes=8 << 20, quantization=quantization)
    model = llm.engine.runner.model
    gc.collect()
    assert [m for f in files for m in _maps_of(f)] == []
    tensors = [t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]
    tensors += list(model.parameters())
    assert not any(t.requires_grad or t.grad_fn is not None for t in tensors)
