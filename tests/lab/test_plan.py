"""kvserve.lab.plan arithmetic against hand-computed values (docs/planning.md) and published parameter counts."""

from __future__ import annotations

import json
import math

import pytest

from kvserve.lab.plan import arith
from kvserve.lab.plan.formats import KVFormat, parse_tensor_format, parse_weight_format
from kvserve.lab.plan.hardware import (
    BUILTIN,
    HardwareProfile,
    get_profile,
    manual_profile,
    profiles_dir,
)
from kvserve.lab.plan.model import (
    PRESETS,
    ModelSpec,
    PlanError,
    TensorShape,
    from_hf_config,
    load_model,
)
from kvserve.lab.plan.planner import Assumptions, Prices, Workload, make_plan

# d=64, L=2, n_q=4, n_kv=2, d_h=16, f=128, V=100.
# per block: q,o 2*64*64 = 8192; k,v 2*64*32 = 4096; MLP 3*64*128 = 24576; norms 2*64 = 128
#   -> 36,992
# blocks 2 * 36,992 = 73,984; final norm 64 -> 74,048; embedding 100*64 = 6,400
TINY = dict(
    name="tiny",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=100,
    max_position_embeddings=512,
)
TIED = ModelSpec(**TINY, tie_word_embeddings=True)
UNTIED = ModelSpec(**TINY, tie_word_embeddings=False)


def test_tiny_parameter_counts_tied_and_untied():
    assert TIED.num_params == 74_048 + 6_400 == 80_448
    assert TIED.num_matmul_params == 80_448  # the tied table is the LM head: a matmul
    assert UNTIED.num_params == 74_048 + 2 * 6_400 == 86_848
    assert UNTIED.num_matmul_params == 86_848 - 6_400 == 80_448  # the input lookup is not


PUBLISHED = {
    "SmolLM2-135M": 134_515_008,
    "SmolLM2-360M": 361_821_120,
    "Llama-2-7B": 6_738_415_616,
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Mistral-7B-v0.1": 7_241_732_096,
    "Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen2.5-7B": 7_615_616_512,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_parameter_count(name):
    assert load_model(name).num_params == PUBLISHED[name]


def test_presets_are_all_tested():
    assert {m.name for m in PRESETS.values()} == set(PUBLISHED)


def test_qwen2_biases_are_the_documented_extra():
    qwen = load_model("Qwen2.5-0.5B-Instruct")
    per_layer_bias = qwen.q_dim + 2 * qwen.kv_dim  # 896 + 2 * 128
    no_bias = ModelSpec(**{**qwen.__dict__, "qkv_bias": False})
    assert qwen.num_params - no_bias.num_params == qwen.num_layers * per_layer_bias == 24 * 1152


def test_hf_config_loading(tmp_path):
    config = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    }
    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model(str(model_dir)).num_params == 494_032_768
    assert load_model(str(model_dir / "config.json")).head_dim == 64
    # Absent num_key_value_heads means multi-head attention; absent head_dim means hidden / heads.
    llama = from_hf_config(
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
        }
    )
    assert (llama.num_kv_heads, llama.head_dim, llama.tie_word_embeddings) == (4, 16, False)


def test_bad_model_inputs_raise_plan_error(tmp_path):
    with pytest.raises(PlanError, match="preset"):
        load_model("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(PlanError, match="num_attention_heads"):
        load_model(str(tmp_path))
    with pytest.raises(PlanError, match="multiple"):
        ModelSpec(**{**TINY, "num_kv_heads": 3}, tie_word_embeddings=True)


@pytest.mark.parametrize(
    "fmt, bits",
    [
        ("int4-g128", 4.125),
        ("int4-g64", 4.25),
        ("int4-g32", 4.5),
        ("int4-g128-zp", 4.25),
        ("int8-g128", 8.125),
        ("bf16", 16),
    ],
)
def test_bits_per_weight_include_scales(fmt, bits):
    f = parse_tensor_format(fmt)
    assert f.nominal_bits_per_weight == bits
    tensor = TensorShape("w", "linear", 256, 1024)
    assert f.num_bytes(tensor) == 256 * 1024 * bits / 8


def test_partial_groups_round_up_and_per_channel_scales():
    row64 = TensorShape("q", "linear", 64, 64)
    assert (
        parse_tensor_format("int4-g128").num_bytes(row64) == 64 * 64 / 2 + 64 * 2
    )  # 1 group per row
    assert parse_tensor_format("int8").num_bytes(row64) == 64 * 64 + 64 * 2  # 1 scale per row
    assert parse_tensor_format("int8").nominal_bits_per_weight is None


def test_tiny_weight_bytes_per_format():
    assert parse_weight_format("bf16").weight_bytes(TIED) == 80_448 * 2
    assert parse_weight_format("fp32").weight_bytes(UNTIED) == 86_848 * 4
    # int8 per channel, per layer: q 4096+128, k 2048+64, v 2048+64, o 4096+128, gate 8192+256,
    # up 8192+256, down 8192+128 = 37,888; x2 layers; norms (320) and embedding (6,400) stay bf16.
    assert parse_weight_format("int8").weight_bytes(TIED) == 2 * 37_888 + 320 * 2 + 6_400 * 2
    # int4-g32: the linears' 73,728 weights at 4.5 bits.
    assert parse_weight_format("int4-g32").weight_bytes(TIED) == 73_728 * 4.5 / 8 + 640 + 12_800
    # mixed: int4-g128 linears (one group per row here: 2 x 19,456 B), int8 embedding with one
    # fp16 scale per row (6,400 + 200), bf16 norms (640).
    assert parse_weight_format("mixed").weight_bytes(TIED) == 2 * 19_456 + 6_600 + 640
    # Untied: the head takes the `head` format.
    fmt = parse_weight_format("linear=bf16,embed=int8,head=fp32")
    assert fmt.weight_bytes(UNTIED) == (73_728 + 320) * 2 + 6_600 + 6_400 * 4


def test_bad_formats_raise_plan_error():
    for bad in ("int9", "q4_k_m", "linear=int4-g0", "attn=int8", "norm=int8"):
        with pytest.raises(PlanError):
            parse_weight_format(bad)
    with pytest.raises(PlanError):
        KVFormat("int4")


def test_kv_bytes_per_token():
    # k = 2 L n_kv d_h b = 2 * 2 * 2 * 16 * b
    assert arith.kv_bytes_per_token(TIED, KVFormat("bf16").bytes_per_value(16)) == 256
    assert arith.kv_bytes_per_token(TIED, KVFormat("fp8").bytes_per_value(16)) == 128
    assert arith.kv_bytes_per_token(TIED, KVFormat("int8").bytes_per_value(16)) == 128 * (
        1 + 2 / 16
    )
    llama = load_model("Llama-3.1-8B")  # 2 * 32 * 8 * 128 * 2 = 131,072 B: 128 kiB per token
    assert arith.kv_bytes_per_token(llama, 2) == 131_072


def test_flops_formulas():
    assert arith.flops_per_token(TIED, 100) == 2 * 80_448 + 4 * 2 * 64 * 100 == 212_096
    assert arith.prefill_flops(TIED, 10) == 2 * 80_448 * 10 + 2 * 2 * 64 * 10**2 == 1_634_560
    assert arith.prefill_flops(TIED, 10, num_cached_tokens=5) == 1_634_560 + 4 * 2 * 64 * 5 * 10


def test_decode_step_by_hand():
    w_bytes, k = 160_896, 256  # bf16 tied; bf16 KV
    # memory: (160,896 + 4 * 256 * 100) / 1e9 = 263.296 us; compute 4 * 212,096 / 1e12 = 0.85 us
    assert arith.decode_step_s(TIED, w_bytes, k, 4, 100, 1e9, 1e12) == pytest.approx(263.296e-6)
    # a slow peak makes it compute-bound: 848,384 / 1e8
    assert arith.decode_step_s(TIED, w_bytes, k, 4, 100, 1e9, 1e8) == pytest.approx(8.48384e-3)
    cost = arith.RooflineCost(TIED, w_bytes, k, 1e9, 1e8)
    assert cost.decode_step_s(4, 100) == pytest.approx(8.48384e-3)
    assert cost.decode_bound(4, 100) == "compute"
    assert arith.RooflineCost(TIED, w_bytes, k, 1e9, 1e12).decode_bound(4, 100) == "memory"


def test_aggregate_decode_approaches_bw_over_kt():
    limit = arith.aggregate_decode_limit_tokens_per_s(1e9, 256, 100)
    batch = 1e7
    aggregate = batch / arith.decode_step_s(TIED, 160_896, 256, batch, 100, 1e9, 1e15)
    assert aggregate == pytest.approx(limit, rel=1e-3)
    assert aggregate < limit


def test_intensities():
    assert arith.gemv_intensity(2) == 1 and arith.gemv_intensity(1) == 2
    assert arith.attention_decode_intensity(load_model("Llama-3.1-8B"), 2) == 2 * 32 / (8 * 2)
    # d-square GEMM over B columns ~ 2B / b while B << d
    assert arith.gemm_intensity(4096, 4096, 8, 2) == pytest.approx(8, rel=0.01)


def test_max_concurrent():
    free = arith.free_cache_bytes(1e6, 160_896, 0)
    assert arith.max_concurrent_sequences(free, 256, 128) == math.floor(839_104 / 32_768) == 25
    assert arith.max_concurrent_sequences(-1, 256, 128) == 0
    # 64 shared tokens stored once: (839,104 - 64 * 256) / (64 * 256)
    assert arith.max_concurrent_shared_prefix(free, 256, 128, 64) == 50


HW = HardwareProfile("test", 1e6, 1e9, 1e10, source="test")
WORK = Workload(prompt_tokens=100, output_tokens=28, requests_per_day=1000)
EXACT = Assumptions(mfu=0.5, bandwidth_fraction=1.0, overhead_bytes=0)


def test_plan_end_to_end_by_hand():
    p = make_plan(TIED, HW, "bf16", "bf16", WORK, EXACT, Prices(price_per_hour_usd=2.0))
    assert p.max_concurrent == 25
    assert p.kv_bytes_per_request == 256 * 128
    # TTFT: 2 * 80,448 * 100 + 2 * 2 * 64 * 100^2 = 18,649,600 FLOPs / (0.5 * 1e10)
    assert p.latency.ttft_cold_s == pytest.approx(3.72992e-3)
    # decode at t = 100 + 28/2 = 114: (160,896 + 256 * 114) / 1e9, memory-bound
    assert p.latency.tpot_solo_s == pytest.approx(1.9008e-4)
    assert p.latency.solo_bound == "memory"
    # B = 25: (160,896 + 25 * 256 * 114) / 1e9 = 890.496 us > 25 * 219,264 / 1e10 = 548.16 us
    assert p.latency.tpot_max_batch_s == pytest.approx(8.90496e-4)
    assert p.latency.tokens_per_s_max_batch == pytest.approx(25 / 8.90496e-4)
    device_s = 3.72992e-3 + 27 * 8.90496e-4 / 25
    assert p.load.device_s_per_request == pytest.approx(device_s)
    assert p.load.output_tokens_per_s == pytest.approx(28 / device_s)
    assert p.load.prefill_share == pytest.approx(3.72992e-3 / device_s)
    assert p.cost.busy_hours_per_day == pytest.approx(1000 * device_s / 3600)
    assert p.cost.num_devices == 1
    per_m_full = 2.0 / (28 / device_s * 3600) * 1e6
    assert p.cost.usd_per_million_output_full_load == pytest.approx(per_m_full)
    assert p.cost.usd_per_million_output == pytest.approx(per_m_full / p.cost.utilisation)
    assert p.intensity.ridge == 10
    assert p.little.arrival_rate_per_s == pytest.approx(1000 / 86400)
    assert p.little.mean_in_system == pytest.approx(p.little.arrival_rate_per_s * p.little.e2e_s)
    assert p.little.stable
    json.dumps(p.to_dict())


def test_plan_defaults_and_cached_prefix():
    h100 = get_profile("H100")
    p = make_plan(load_model("Llama-3.1-8B"), h100, workload=Workload(4000, 500, 3000))
    assert p.assumptions.bandwidth_fraction == 0.8  # a datasheet peak is not reached
    assert p.bandwidth_bytes_per_s == pytest.approx(0.8 * 3.35e12)
    assert p.latency.ttft_cached_s < p.latency.ttft_cold_s
    assert p.max_concurrent_shared_prefix > p.max_concurrent
    measured = HardwareProfile("m", 1e10, 2e10, 1e11, measured=True)
    assert make_plan(TIED, measured).assumptions.bandwidth_fraction == 1.0


def test_model_that_does_not_fit():
    p = make_plan(load_model("Llama-2-7B"), get_profile("l4"), "fp32")
    assert p.max_concurrent == 0 and p.load is None and p.cost is None
    assert any("do not fit" in n for n in p.notes)


def test_owned_device_price():
    hourly, how = Prices(device_cost_usd=1800, power_w=450).hourly_usd(HW)
    assert hourly == pytest.approx(1800 / (3 * 8760) + 0.45 * 0.15)
    assert "owned" in how
    assert Prices().hourly_usd(HW)[0] is None
    assert Prices().hourly_usd(get_profile("rtx-4090"))[0] == pytest.approx(1800 / 26280 + 0.0675)


def test_hardware_profiles():
    names = {"h100-sxm", "a100-80gb", "l40s", "l4", "rtx-4090", "m2-ultra", "ddr5-desktop"}
    assert set(BUILTIN) == names
    assert all(get_profile(name).source for name in names)
    assert get_profile("H100 SXM") is BUILTIN["h100-sxm"]
    edited = manual_profile(None, 500, None, base=get_profile("l4"))
    assert edited.bandwidth_bytes_per_s == 500e9 and edited.memory_bytes == 24e9
    assert manual_profile(16, 100, 10).peak_flops_per_s == 10e12
    with pytest.raises(PlanError):
        manual_profile(16, None, 10)
    with pytest.raises(PlanError):
        get_profile("tpu-v9")


def test_profiles_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert profiles_dir() == tmp_path / "profiles"
    monkeypatch.delenv("KVSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profiles_dir() == tmp_path / "xdg" / "kvserve" / "profiles"
    with pytest.raises(PlanError, match="--measure"):
        get_profile("this-machine")
