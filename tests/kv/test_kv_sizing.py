"""The KV cache's default size from the machine's memory (kvserve/memory.py), the explicit options
that override it, and the startup banner that says how it was chosen and names the weight format."""

from __future__ import annotations

import math

import pytest

from kvserve.engine.args import EngineArgs
from kvserve.engine.wire import EngineInfo
from kvserve.memory import MemoryReading, auto_kv_cache_bytes, read_available_memory
from kvserve.quant.describe import describe_weights
from kvserve.quant.scheme import parse_weight_scheme
from kvserve.server.startup import startup_summary

GIB, MIB = 2**30, 2**20


def _size(available_bytes, **overrides):
    args = dict(weights_bytes=1 * GIB, kv_bytes_per_token=20480, block_size=16,
                max_model_len=512, max_num_seqs=64)  # fmt: skip
    args.update(overrides)
    reading = MemoryReading(available_bytes, "MemAvailable")
    return auto_kv_cache_bytes(reading, **args)


def test_half_of_what_the_weights_leave():
    # an 8k-context model with 128 KiB/token on 8 GiB: 50% of (8 - 2) GiB = 3 GiB, not 512 MiB
    size = _size(8 * GIB, weights_bytes=2 * GIB, kv_bytes_per_token=128 * 1024,
                 max_model_len=8192, max_num_seqs=64)  # fmt: skip
    assert size.num_bytes == 3 * GIB
    # on 24 GiB, 50% of (24 - 4) GiB would be 10 GiB: at most 4 GiB by default (vLLM CPU's default)
    size = _size(24 * GIB, weights_bytes=4 * GIB, kv_bytes_per_token=128 * 1024,
                 max_model_len=8192, max_num_seqs=64)  # fmt: skip
    assert size.num_bytes == 4 * GIB and "at most 4 GiB" in size.reason
    assert size.num_bytes // (128 * 1024 * 8192) == 4  # full-length sequences at once
    assert size.reason == "50% of 20.0 GiB (MemAvailable 24.0 GiB - weights 4.0 GiB), at most 4 GiB by default"


def test_capped_at_what_the_running_sequences_can_use():
    size = _size(64 * GIB)  # the demo's shape: 64 x 512 tokens x 20 KiB = 640 MiB
    assert size.num_bytes == 64 * 512 * 20480 == 640 * MIB
    assert size.reason.endswith("capped at 64 sequences x 512 tokens")
    # a length that is not a whole number of blocks: each sequence takes whole blocks
    size = _size(64 * GIB, max_model_len=500, max_num_seqs=3)
    assert size.num_bytes == 3 * math.ceil(500 / 16) * 16 * 20480


def test_never_less_than_one_full_length_sequence():
    size = _size(1 * GIB + 4 * MIB)  # 2 MiB to share, one 512-token sequence needs 10 MiB
    assert size.num_bytes == 512 * 20480
    assert "less than one 512-token sequence" in size.reason and "--kv-cache-memory" in size.reason
    assert _size(0).num_bytes == 512 * 20480  # weights larger than what is available


def test_no_reading_falls_back_to_512_mib_within_bounds():
    args = dict(weights_bytes=0, kv_bytes_per_token=20480, block_size=16, max_model_len=512)
    assert auto_kv_cache_bytes(None, max_num_seqs=64, **args).num_bytes == 512 * MIB
    assert auto_kv_cache_bytes(None, max_num_seqs=2, **args).num_bytes == 2 * 512 * 20480


def test_reading_takes_the_smaller_of_meminfo_and_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24683784 kB\nMemAvailable:    8388608 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert read_available_memory(meminfo, cgroup) == MemoryReading(8 * GIB, "MemAvailable")
    (cgroup / "memory.max").write_text(f"{4 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{1 * GIB}\n")
    assert read_available_memory(meminfo, cgroup) == MemoryReading(3 * GIB, "cgroup limit - usage")
    (cgroup / "memory.max").write_text("max\n")  # no limit: MemAvailable
    assert read_available_memory(meminfo, cgroup).source == "MemAvailable"
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{1 * GIB}")
    assert read_available_memory(meminfo, v1).available_bytes == 1 * GIB
    assert read_available_memory(tmp_path / "none", tmp_path / "none") is None


def test_engine_config_is_sized_from_memory_unless_told(monkeypatch):
    import kvserve.engine.args as args_module

    monkeypatch.setattr(args_module, "device_memory_reading",
                        lambda device: MemoryReading(3 * GIB, "MemAvailable"))  # fmt: skip
    config = EngineArgs(model="kvserve-demo", max_num_seqs=256).create_engine_config()
    weights = 2 * (args_module.checkpoint_bytes(config.model_dir))  # bf16 file, fp32 at run time
    assert config.cache.kv_cache_memory_bytes == (3 * GIB - weights) // 2
    assert config.cache.sizing.startswith("auto: 50% of ")
    explicit = EngineArgs(kv_cache_memory_bytes=64 * MIB).create_engine_config()
    assert explicit.cache.kv_cache_memory_bytes == 64 * MIB
    assert explicit.cache.sizing == "--kv-cache-memory 64MiB"
    assert EngineArgs(num_blocks=10).create_engine_config().cache.sizing == "--num-blocks 10"


def _info(**overrides) -> EngineInfo:
    values = dict(model_dir="/m", model_type="llama", dtype="float32", device="cpu",
                  quantization=None, vocab_size=1000, num_layers=2, max_model_len=512,
                  num_blocks=64, block_size=16, kv_bytes_per_token=1024, max_num_seqs=8,
                  max_num_batched_tokens=256, enable_prefix_caching=True, admission="on_demand",
                  speculative="off", tokenizer=None)  # fmt: skip
    values.update(overrides)
    return EngineInfo(**values)


def test_banner_names_the_weight_format_and_the_kv_sizing():
    weights = describe_weights("float32", "int8", "rtn")
    text = startup_summary(
        _info(quantization="int8", weights=weights, kv_cache_sizing="auto: 50% of 1.0 GiB"),
        "demo",
        "http://h:1",
    )
    assert "  weights    int8 (rtn), activations int8 per 32-input block (Q8_0), sums fp32" in text
    assert "  KV sizing  auto: 50% of 1.0 GiB" in text


@pytest.mark.parametrize(
    ("quantization", "method", "expected"),
    [
        (None, "rtn", "fp32, activations fp32"),
        ("w8a8", "smoothquant", "w8a8 (smoothquant), activations int8 per token (W8A8), sums fp32"),
        (
            "int4-g128",
            "gptq",
            "int4-g128 (gptq), activations int8 per 32-input block (Q8_0), sums fp32",
        ),
        (
            "linear=bf16,head=bf16",
            "rtn",
            "linear=bf16,head=bf16, bf16 products, activations and sums fp32",
        ),
    ],
)
def test_describe_weights(quantization, method, expected):
    assert describe_weights("float32", quantization, method) == expected
    if quantization is not None:  # the engine passes the scheme it parsed once, not the string
        scheme = parse_weight_scheme(quantization)
        assert describe_weights("float32", scheme, method) == expected
