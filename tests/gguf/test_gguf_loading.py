"""Tiny GGUF files of a random Llama, each quantised type written by `gguf` itself, served by kvserve and
compared with transformers reading the same file (the oracle); bad model files as one-line errors."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.errors import ModelLoadError
from kvserve.core.sampling_params import SamplingParams
from kvserve.gguf.model_dir import gguf_model_dir
from kvserve.quant.scheme import QuantizationError
from tests.checkpoints import build_checkpoint
from tests.gguf_files import write_llama_gguf

PROMPT = [1, 5, 9, 33, 100, 7, 250, 64, 12, 300, 3, 44]
# fp32 activations times exactly dequantised weights on both sides; only the order of fp32 sums differs
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-hf")
    return build_checkpoint(root / "hf", "llama", vocab_size=320, rope_scaling=None)


def _transformers_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_logits_and_greedy_equal_transformers(tiny_model, tmp_path, ggml_type):
    from kvserve.engine.llm import LLM

    path = write_llama_gguf(tmp_path / f"tiny-{ggml_type}.gguf", tiny_model, ggml_type, "Q8_0")
    expected = _transformers_logits(path, PROMPT)
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=16 << 20, gguf_activations="fp32")
    got = llm.engine.score(PROMPT)
    assert (got - expected).abs().max().item() <= LOGIT_ATOL
    # greedy continuation, batched beside another prompt, equals transformers' argmax chain
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPT, PROMPT[:5]], params)[0].outputs[0].token_ids
    ids = list(PROMPT)
    for _ in range(8):
        ids.append(int(_transformers_logits(path, ids)[-1].argmax()))
    assert list(out) == ids[len(PROMPT) :]


def test_requantised_with_quantization_fp32_is_the_dequantised_model(tiny_model, tmp_path):
    from kvserve.engine.llm import LLM

    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_model, "Q4_1", "Q8_0")
    exact = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=8 << 20, gguf_activations="fp32")
    blocks = exact.engine.score(PROMPT)
    dense = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=8 << 20,
                quantization="fp32").engine.score(PROMPT)  # fmt: skip
    assert (blocks - dense).abs().max().item() <= LOGIT_ATOL


def test_chat_template_that_escapes_its_sandbox_is_a_load_error(tiny_model, tmp_path):
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    path = write_llama_gguf(tmp_path / "escape.gguf", tiny_model, chat_template=template)
    with pytest.raises(ModelLoadError, match="chat_template tries to leave its sandbox") as info:
        gguf_model_dir(path)
    assert "\n" not in str(info.value)


def test_chat_template_syntax_error_is_a_load_error(tiny_model, tmp_path):
    path = write_llama_gguf(tmp_path / "syntax.gguf", tiny_model, chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match="chat_template line 1"):
        gguf_model_dir(path)


def test_tensor_shapes_that_disagree_with_the_metadata(tiny_model, tmp_path):
    from kvserve.engine.llm import LLM

    wrong = build_checkpoint(tmp_path / "hf", "llama", vocab_size=320, rope_scaling=None,
                             intermediate_size=96)  # fmt: skip
    path = write_llama_gguf(tmp_path / "shapes.gguf", wrong, "Q8_0")
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4  # past the value type: the uint32 value
    data[at : at + 4] = (128).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="the metadata implies"):
        LLM(str(path), max_model_len=64, kv_cache_memory_bytes=8 << 20)


def test_unsupported_quantisation_type_is_named(tiny_model, tmp_path):
    import struct

    from gguf import GGMLQuantizationType as T

    from kvserve.engine.llm import LLM

    path = write_llama_gguf(tmp_path / "iq.gguf", tiny_model, "Q4_0", "Q8_0")
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == T.Q4_0
    # IQ4_NL has Q4_0's block (32 values in 18 bytes): the header stays valid, the type is unsupported
    struct.pack_into("<I", data, at, T.IQ4_NL)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="IQ4_NL.*Q4_0.*Q8_0") as info:
        LLM(str(path), max_model_len=64, kv_cache_memory_bytes=8 << 20)
    assert "\n" not in str(info.value)


def _rounded(x: torch.Tensor, round_activations, act: str) -> torch.Tensor:
    return round_activations(x.reshape(-1, x.shape[-1]), act).reshape(x.shape)


@pytest.mark.parametrize("mode, act", [("int8", "block"), ("int8x2", "block2")])
@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_int8_activations_run_the_file_codes_on_the_panel_kernel(
    tiny_model, tmp_path, ggml_type, mode, act
):
    """--gguf-activations int8 / int8x2: every linear on the integer panel kernel, with the file's
    codes and scales as they are; the oracle is transformers on the same file with each linear
    computing round_activations(x, act) @ W^T in fp32 (W the transcoded weight: the file's, Q4_1's
    fp16 zero-point aside)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from kvserve.engine.llm import LLM
    from kvserve.gguf.reader import open_gguf
    from kvserve.gguf.weights import read_gguf_weights
    from kvserve.model.block_weights import as_quantized_tensor
    from kvserve.model.qlinear import QuantLinear, round_activations

    path = write_llama_gguf(tmp_path / f"tiny-{ggml_type}.gguf", tiny_model, ggml_type, "Q8_0")
    cfg = tiny_model.config
    blocks = read_gguf_weights(open_gguf(path), cfg.num_attention_heads,
                               cfg.num_key_value_heads, keep_blocks=True)  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for name, module in ref.named_modules():
        if isinstance(module, torch.nn.Linear):
            bw = blocks.get(f"{name}.weight", blocks["model.embed_tokens.weight"])
            qt = as_quantized_tensor([bw])
            assert qt is not None, name
            dequant = bw.dequantize()
            if bw.ggml_type == "Q4_1":  # the zero-point's fp16 rounding only
                bound = (qt.scales.float() * qt.zeros.float()).abs().repeat_interleave(32, 1)
                assert ((qt.dequantize() - dequant).abs() <= bound * 2**-11 + 1e-6).all()
            else:
                assert torch.equal(qt.dequantize(), dequant), name
            weight = qt.dequantize()
            module.forward = lambda x, w=weight: F.linear(_rounded(x, round_activations, act), w)
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=16 << 20, gguf_activations=mode)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down; the head
    assert all(m.layout == "panel" and m.scheme.act == act for m in linears)
    got = llm.engine.score(PROMPT)
    # the same integer sums; fp32 scale products in another order, and a rare activation code one
    # step apart where the two routes' inputs differ in the last bit
    assert (got - expected).abs().max().item() <= 1e-3
    with pytest.raises(QuantizationError, match="drop --quantization"):
        LLM(str(path), max_model_len=64, quantization="int8", gguf_activations="int8")


def test_auto_gguf_activations_is_int8x2_where_the_file_runs_on_the_panel_kernel(tiny_model, tmp_path):
    """The default, --gguf-activations auto, is decided once in the engine's config: int8x2 (close
    to the exact path, tests/gguf/test_gguf_int8x2.py) for a file whose every matrix is a
    panel-kernel block, run as it is on one CPU rank in float32; fp32, the exact path, where the blocks are requantised or
    dequantised (tensor parallelism), where a matrix has another type, or in another dtype."""
    from kvserve.engine.args import build_engine_config
    from kvserve.model.qlinear import QuantLinear

    q4 = gguf_model_dir(write_llama_gguf(tmp_path / "q4.gguf", tiny_model, "Q4_1", "Q8_0"))
    f16 = gguf_model_dir(write_llama_gguf(tmp_path / "f16.gguf", tiny_model, "F16", "F16"))
    options = {"max_model_len": 64, "kv_cache_memory_bytes": 8 << 20}

    def decided(model_dir, **extra) -> str:
        return build_engine_config(model_dir, **options, **extra).gguf_activations

    assert decided(q4) == "int8x2"
    assert decided(q4, gguf_activations="fp32") == "fp32"
    assert decided(q4, quantization="int8") == "fp32"
    assert decided(q4, dtype="bfloat16") == "fp32"
    assert decided(q4, tensor_parallel_size=2) == "fp32"
    assert decided(f16) == "fp32"
    mixed = gguf_model_dir(write_llama_gguf(tmp_path / "mixed.gguf", tiny_model, "Q4_1", "F16"))
    assert decided(mixed) == "fp32"  # one matrix the panel kernel does not run: all stay exact
    # what was decided is what runs: the linears on the panel kernel, and the same logits as asking
    from kvserve.engine.llm import LLM

    auto = LLM(str(q4), **options)
    assert all(m.layout == "panel" for m in auto.engine.runner.model.modules()
               if isinstance(m, QuantLinear))  # fmt: skip
    asked = LLM(str(q4), **options, gguf_activations="int8x2")
    assert torch.equal(auto.engine.score(PROMPT), asked.engine.score(PROMPT))


def test_prompt_tokens_beside_decoding_rows_are_capped_by_default_on_the_integer_kernel(
    tiny_model, tmp_path
):
    """--max-prompt-tokens-beside-decode's default is decided with the products: 48 where a GGUF
    model runs on the integer panel kernel (a step's time grows with its prompt tokens: serving
    measurements in docs/performance.md), 0 (the whole budget) on the exact path and for other
    checkpoints; a value given is kept."""
    from kvserve.config import PROMPT_CAP_ON_INTEGER_PRODUCTS
    from kvserve.engine.args import build_engine_config

    q4 = gguf_model_dir(write_llama_gguf(tmp_path / "q4.gguf", tiny_model, "Q4_1", "Q8_0"))
    options = {"max_model_len": 64, "kv_cache_memory_bytes": 8 << 20}

    def cap(model_dir, **extra) -> int:
        config = build_engine_config(model_dir, **options, **extra)
        return config.scheduler.max_prompt_tokens_beside_decode

    assert PROMPT_CAP_ON_INTEGER_PRODUCTS == 48
    assert cap(q4) == cap(q4, gguf_activations="int8") == 48
    assert cap(q4, gguf_activations="fp32") == 0
    assert cap(q4, max_prompt_tokens_beside_decode=0) == 0
    assert cap(q4, max_prompt_tokens_beside_decode=16) == 16
    hf = tmp_path / "hf"
    build_checkpoint(hf, "llama", vocab_size=320, rope_scaling=None)
    assert cap(hf, gguf_activations="int8") == 0  # not a GGUF model: the option is unused
