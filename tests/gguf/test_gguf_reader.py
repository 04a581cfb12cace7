"""The GGUF header reader (kvserve/gguf/reader.py): the same values as `gguf.GGUFReader` on real and
tiny files, and a one-line `ModelLoadError` for every kind of bad file, with no allocation driven by
a size the file cannot hold."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvserve.core.errors import ModelLoadError, UnsupportedModelError
from kvserve.gguf.config import hf_config, unpermute_rows
from kvserve.gguf.reader import open_gguf
from tests.checkpoints import build_checkpoint
from tests.gguf_files import _permute, write_llama_gguf
from tests.real_models import smollm2_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    model = build_checkpoint(root / "hf", "llama_tied", vocab_size=320, rope_scaling=None)
    return write_llama_gguf(root / "tiny.gguf", model, "Q8_0")


def _same_as_gguf_reader(path) -> None:
    from gguf import GGUFReader

    ours, theirs = open_gguf(path), GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert len(ours.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.dims == tuple(int(d) for d in tensor.shape)
        assert info.ggml_type == tensor.tensor_type
        raw = ours.raw(tensor.name)
        assert np.array_equal(raw.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_reads_what_gguf_reads_on_a_tiny_file(tiny_gguf):
    _same_as_gguf_reader(tiny_gguf)


def test_reads_what_gguf_reads_on_smollm2():
    _same_as_gguf_reader(smollm2_gguf())


def test_smollm2_config():
    config = hf_config(open_gguf(smollm2_gguf()))
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        576, 30, 1536,
    )  # fmt: skip
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192 and config["rope_theta"] == 100000.0
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1


def test_unpermute_inverts_the_converters_permutation():
    rows = np.arange(24 * 3).reshape(24, 3)
    for heads in (1, 2, 3):
        permuted = _permute(rows, heads)
        assert np.array_equal(permuted[unpermute_rows(24, heads)], rows)


# --- bad files ------------------------------------------------------------------------------------


def _error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        open_gguf(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def _patched(tmp_path, data: bytes, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _string_at(data: bytes, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    return data[offset + 8 : offset + 8 + length].decode(), offset + 8 + length


def test_truncated_file(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    assert "truncated" in _error(_patched(tmp_path, data[: len(data) // 2], "half.gguf"))
    assert "truncated" in _error(_patched(tmp_path, data[:100], "header.gguf"))
    assert "too short" in _error(_patched(tmp_path, data[:10], "tiny.gguf"))


def test_wrong_magic_and_version(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    assert "magic" in _error(_patched(tmp_path, b"GGML" + data[4:], "magic.gguf"))
    for version in (1, 4, 2**31):
        bad = data[:4] + struct.pack("<I", version) + data[8:]
        assert f"version {version}" in _error(_patched(tmp_path, bad, f"v{version}.gguf"))


def test_absurd_counts_and_lengths_are_refused_before_any_allocation(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    huge = struct.pack("<Q", 2**60)
    # the tensor count, then the metadata count
    assert "cannot fit" in _error(_patched(tmp_path, data[:8] + huge + data[16:], "tensors.gguf"))
    assert "cannot fit" in _error(_patched(tmp_path, data[:16] + huge + data[24:], "kv.gguf"))
    # the first key's length
    assert "remain" in _error(_patched(tmp_path, data[:24] + huge + data[32:], "key.gguf"))


def _find_array(data: bytes, key: str) -> int:
    """Offset of the item count of the array value under `key`."""
    encoded = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(encoded) + len(encoded)
    assert struct.unpack_from("<I", data, at)[0] == 9  # an array
    return at + 8  # past the value type and the item type


def test_absurd_array_length(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    at = _find_array(data, "tokenizer.ggml.tokens")
    bad = data[:at] + struct.pack("<Q", 2**61) + data[at + 8 :]
    assert "claims" in _error(_patched(tmp_path, bad, "array.gguf"))
    at = _find_array(data, "tokenizer.ggml.token_type")
    bad = data[:at] + struct.pack("<Q", 2**61) + data[at + 8 :]
    assert "remain" in _error(_patched(tmp_path, bad, "scalars.gguf"))


def _tensor_info_offset(data: bytes, name: str) -> int:
    encoded = struct.pack("<Q", len(name)) + name.encode()
    return data.index(encoded) + len(encoded)


def test_absurd_dimension_count_and_sizes(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    at = _tensor_info_offset(data, "blk.0.attn_q.weight")
    bad = data[:at] + struct.pack("<I", 1000) + data[at + 4 :]
    assert "1000 dimensions" in _error(_patched(tmp_path, bad, "dims.gguf"))
    bad = data[:at + 4] + struct.pack("<Q", 2**40) + data[at + 12 :]  # fmt: skip
    assert "more data than the file" in _error(_patched(tmp_path, bad, "size.gguf"))
    bad = data[:at + 4] + struct.pack("<Q", 33) + data[at + 12 :]  # fmt: skip
    assert "multiple of" in _error(_patched(tmp_path, bad, "block.gguf"))


def test_unknown_tensor_type(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    at = _tensor_info_offset(data, "blk.0.attn_q.weight") + 4 + 2 * 8
    bad = data[:at] + struct.pack("<I", 9999) + data[at + 4 :]
    assert "unknown ggml type 9999" in _error(_patched(tmp_path, bad, "type.gguf"))


def test_unknown_architecture(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    # same length, so every offset stays valid: "llama" -> "llamb"
    bad = data.replace(struct.pack("<Q", 5) + b"llama", struct.pack("<Q", 5) + b"llamb", 1)
    path = _patched(tmp_path, bad, "arch.gguf")
    with pytest.raises(UnsupportedModelError, match="'llamb' is not supported; supported: .*llama"):
        hf_config(open_gguf(path))
