"""The light tokenizer (kvserve/tokenizer/light.py) against its oracle, transformers' AutoTokenizer,
on every tokenizer the project builds offline: equal ids, text, tokens, special tokens and vocabulary.
Where the light path does not apply, the API process gets AutoTokenizer's tokenizer and says why;
unreadable files are a ModelLoadError."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoTokenizer

from kvserve.core.errors import ModelLoadError
from kvserve.tokenizer import LightTokenizer, load_api_tokenizer, load_tokenizer
from kvserve.tokenizer.files import (
    _BACKEND_MODEL_IDS,
    _CLASS_OVERRIDDEN_MODEL_TYPES,
    light_path_refusal,
    read_tokenizer_files,
)
from tests import tokenizer_dirs as dirs
from tests.checkpoints import GPT2_TOKENIZER
from tests.real_models import gemma3_gguf, smollm2_gguf

TEXTS = [
    "",
    " ",
    "Hello world",
    "hello, world! Don't stop: it's 2024 and we're at 99.5% .",
    "  leading and trailing   spaces   ",
    "tabs\tand\nnewlines\r\n\n\n  indented\n",
    "héllo wörld ünïcödé ✓ 日本語のテキスト Ελληνικά",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 and a ZWJ",
    "digits 1234567890 0.000001 1e-9",
    "<s>[INST] special strings inside text [/INST]</s> <|im_start|>user\nhi<|im_end|>",
    "<|endoftext|><|bos|><|end|><bos><eos><think>x</think>",
    "\u00a0non-breaking\u2028line separator\ufeffBOM",
    "code: def f(x):\n    return {'a': [1, 2]}  # comment",
    "a" * 300,
]

# name -> a function of a tmp path giving the directory (the GGUF ones skip when not installed)
SOURCES = {
    "demo": lambda tmp: dirs.DEMO,
    "gpt2": lambda tmp: GPT2_TOKENIZER,
    "gpt2_class_with_digits": dirs.gpt2_class_with_digits,
    "llama2_style": dirs.llama2_style,
    "mistral_legacy_style": dirs.mistral_legacy_style,
    "qwen3_style": dirs.qwen3_style,
    "gemma_style": dirs.gemma_style,
    "smollm2_gguf": lambda tmp: _gguf_dir(smollm2_gguf()),
    "gemma3_gguf": lambda tmp: _gguf_dir(gemma3_gguf()),
}


def _gguf_dir(path):
    from kvserve.gguf.model_dir import gguf_model_dir

    return gguf_model_dir(path)


PARAMS = [
    pytest.param(name, marks=pytest.mark.slow) if name == "gemma3_gguf" else name
    for name in SOURCES
]


@pytest.fixture(scope="module", params=PARAMS)
def pair(request, tmp_path_factory):
    """(light, transformers) tokenizers of one directory."""
    path = SOURCES[request.param](tmp_path_factory.mktemp(request.param))
    assert light_path_refusal(read_tokenizer_files(path)) is None
    return LightTokenizer.load(path), AutoTokenizer.from_pretrained(str(path))


def _special_ids(hf) -> list[int]:
    return sorted(set(hf.all_special_ids) | set(hf.added_tokens_decoder))


def test_encode_equals_transformers(pair):
    light, hf = pair
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = hf.encode(text, add_special_tokens=add_special_tokens)
            assert light.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_decode_equals_transformers(pair):
    """The ids of every text, special ids among them, single ids (byte-fallback pieces decode to
    U+FFFD alone), a byte-fallback character cut in two, the vocabulary's first and last ids."""
    light, hf = pair
    specials = _special_ids(hf)
    sequences = [hf.encode(text) for text in TEXTS]
    sequences += [specials, specials[:2] + hf.encode("a b c") + specials[-2:], []]
    emoji = hf.encode("😀👍🏽", add_special_tokens=False)
    sequences += [emoji[:k] for k in range(len(emoji) + 1)]
    size = len(hf)
    sequences += [[i] for i in [*range(min(size, 300)), *range(max(0, size - 50), size)]]
    sequences += [list(range(min(size, 400)))]
    for ids in sequences:
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
    assert light.decode(specials[0]) == hf.decode(specials[0])


def test_tokens_and_ids_equal_transformers(pair):
    light, hf = pair
    ids = [*range(min(len(hf), 500)), *_special_ids(hf), len(hf) - 1]
    assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
        ids, skip_special_tokens=True
    )
    assert [light.convert_ids_to_tokens(i) for i in ids[:50]] == [
        hf.convert_ids_to_tokens(i) for i in ids[:50]
    ]
    tokens = hf.convert_ids_to_tokens(ids[:100]) + hf.all_special_tokens
    assert light.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)


def test_special_tokens_and_vocabulary_equal_transformers(pair):
    light, hf = pair
    for name in ("special_tokens_map", "all_special_tokens", "all_special_ids", "vocab_size"):
        assert getattr(light, name) == getattr(hf, name), name
    for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        assert getattr(light, f"{name}_token") == getattr(hf, f"{name}_token"), name
        assert getattr(light, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
    assert len(light) == len(hf) and light.get_vocab() == hf.get_vocab()
    assert light.chat_template == hf.chat_template
    assert light.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces
    assert {
        t.content: t.special for t in light.backend_tokenizer.get_added_tokens_decoder().values()
    } == {t.content: t.special for t in hf.backend_tokenizer.get_added_tokens_decoder().values()}


def test_the_rebuilt_gpt2_class_drops_the_files_digit_split(tmp_path):
    """The case the light path must not take literally: tokenizer.json splits digits and lowercases,
    GPT2Tokenizer's own code does neither."""
    path = dirs.gpt2_class_with_digits(tmp_path / "t")
    light, hf = LightTokenizer.load(path), AutoTokenizer.from_pretrained(str(path))
    ids = light.encode("Year 2024")
    assert ids == hf.encode("Year 2024")
    assert light.decode(ids) == " Year 2024"  # add_prefix_space, no lowercasing, "2024" whole
    assert light.bos_token == light.eos_token == light.unk_token == "<|endoftext|>"


# --- where the API process falls back to transformers --------------------------------------------


FALLBACKS = {
    "a class of its own": ({"tokenizer_class": "LlamaTokenizerFast"}, "LlamaTokenizerFast"),
    "no class": ({}, "names no tokenizer_class"),
    "remote code": (
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "auto_map": {"AutoTokenizer": ["a.B", None]},
        },
        "remote code",
    ),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_the_light_path_refuses_what_transformers_builds_its_own_way(tmp_path, name):
    config, reason = FALLBACKS[name]
    path = dirs.copy_of(dirs.DEMO, tmp_path / "m", tokenizer_config__json=config)
    assert reason in light_path_refusal(read_tokenizer_files(path))


def test_the_api_process_falls_back_to_transformers_and_says_why(tmp_path, caplog):
    """Qwen 2's model type: transformers uses Qwen2Tokenizer whatever tokenizer_config.json says."""
    path = dirs.copy_of(dirs.DEMO, tmp_path / "m", config__json={"model_type": "qwen2"})
    with caplog.at_level(logging.WARNING, logger="kvserve.tokenizer"):
        tokenizer = load_api_tokenizer(path)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert "model type 'qwen2'" in caplog.text and "with transformers" in caplog.text
    assert tokenizer.encode("hi there") == AutoTokenizer.from_pretrained(str(path)).encode(
        "hi there"
    )


def test_a_sentencepiece_model_without_tokenizer_json_takes_transformers(tmp_path):
    path = dirs.copy_of(dirs.DEMO, tmp_path / "m", tokenizer__json=None)
    (path / "tokenizer.model").write_bytes(b"\x00")
    assert "no tokenizer.json" in light_path_refusal(read_tokenizer_files(path))


def test_the_overridden_model_types_and_ids_cover_transformers_lists():
    """transformers replaces the declared class for these model types and Hub ids; a new one would
    make the light path wrong for it."""
    from transformers.models.auto import tokenization_auto

    overridden = tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert overridden <= _CLASS_OVERRIDDEN_MODEL_TYPES
    assert set(tokenization_auto.MODEL_IDS_TO_TOKENIZERS_BACKEND) <= set(_BACKEND_MODEL_IDS)


def test_a_hub_id_transformers_special_cases_is_refused(tmp_path):
    config = {"model_type": "llama", "_name_or_path": "deepseek-ai/deepseek-coder-1.3b-instruct"}
    path = dirs.copy_of(dirs.DEMO, tmp_path / "m", config__json=config)
    assert "by its name" in light_path_refusal(read_tokenizer_files(path))


def test_the_default_and_demo_models_take_the_light_path():
    assert isinstance(load_api_tokenizer(dirs.DEMO), LightTokenizer)
    assert isinstance(load_api_tokenizer(_gguf_dir(smollm2_gguf())), LightTokenizer)


# --- unreadable files ----------------------------------------------------------------------------

BAD_FILES = {
    "tokenizer.json not JSON": {"tokenizer__json": "{not json"},
    "tokenizer.json not a tokenizer": {"tokenizer__json": {"model": {"type": "Nope"}}},
    "tokenizer.json not UTF-8": {"tokenizer__json": b"\xff\xfe{}"},
    "tokenizer_config.json a list": {"tokenizer_config__json": ["PreTrainedTokenizerFast"]},
    "tokenizer_config.json truncated": {"tokenizer_config__json": '{"tokenizer_class": "Pre'},
    "chat_template.jinja not UTF-8": {"chat_template__jinja": b"{{ \xff }}"},
    "a named token not a string": {
        "tokenizer_config__json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": 7}
    },
    "an added token not an object": {
        "tokenizer_config__json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": {"0": "<|bos|>"},
        }
    },
    "an added token's content a number": {
        "tokenizer_config__json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": {"0": {"content": 5}},
        }
    },
    "special_tokens_map.json a string": {
        "tokenizer_config__json": {"tokenizer_class": "PreTrainedTokenizerFast"},
        "special_tokens_map__json": '"<s>"',
    },
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_bad_tokenizer_files_are_a_model_load_error(tmp_path, name):
    path = dirs.copy_of(dirs.DEMO, tmp_path / "m", **BAD_FILES[name])
    with pytest.raises(ModelLoadError) as info:
        load_api_tokenizer(path)
    assert str(path) in str(info.value)


def test_the_engine_cores_tokenizer_refuses_a_corrupt_file_with_a_model_load_error(tmp_path):
    """The core's loader (transformers' AutoTokenizer) gets the same typed error: the tokenizers
    library raises a plain Exception for a tokenizer.json it cannot read, which used to escape
    `load_tokenizer` and crash the engine core's start."""
    path = dirs.copy_of(dirs.DEMO, tmp_path / "m", **BAD_FILES["tokenizer.json not a tokenizer"])
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)
