"""kvserve.gguf.tokenizer against transformers' own GGUF tokenizer conversion (the oracle).

For the two real models the oracle's ids come from committed fixtures (tools/gguf_fixtures/
tokenizer_ids.py; converting Gemma's vocabulary in transformers takes about a minute); for tiny
GGUF files written here the oracle runs live, through the same fixture code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from kvserve.core.errors import ModelLoadError
from kvserve.gguf.tokenizer import build_tokenizer, tokenizer_config
from kvserve.paths import sha256_file
from tests import FIXTURES
from tests.real_models import gemma3_gguf, gguf_metadata, smollm2_gguf
from tools.gguf_fixtures.tokenizer_ids import read_fixture, reference_fixture, write_fixture

FIXTURES = FIXTURES / "gguf_tokenizer"


@dataclass(frozen=True)
class RealModel:
    find_file: Callable[[], Path]
    fixture_name: str
    # The pre-tokenizer transformers' conversion uses where it differs from llama.cpp's, else None.
    # For pre "smollm" llama.cpp (and SmolLM2's own tokenizer.json) isolates every digit before the
    # GPT-2 split; transformers has no entry for "smollm" and falls back to GPT-2's ByteLevel regex.
    oracle_pre_tokenizer: Callable[[], object] | None = None


REAL_MODELS = {
    "smollm2": RealModel(
        smollm2_gguf,
        "smollm2-135m-instruct.json.gz",
        lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ),
    "gemma3": RealModel(gemma3_gguf, "gemma-3-270m.json.gz"),
}


def save_for_transformers(metadata: dict, directory: Path):
    """What kvserve writes beside a GGUF, loaded back with `AutoTokenizer`."""
    from transformers import AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(metadata).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata)))
    return AutoTokenizer.from_pretrained(str(directory))


def fixture_ids(fixture: dict, with_special: bool) -> list[list[int]]:
    prefix, suffix = (
        (fixture["special_prefix"], fixture["special_suffix"]) if with_special else ([], [])
    )
    return [prefix + [int(i) for i in ids.split()] + suffix for ids in fixture["ids"]]


def mismatched_lines(fixture: dict, ids_per_line: list[list[int]], with_special: bool) -> list[int]:
    expected = fixture_ids(fixture, with_special)
    return [
        n for n, (got, want) in enumerate(zip(ids_per_line, expected, strict=True)) if got != want
    ]


def assert_matches_fixture(tokenizer, fixture: dict, skip: frozenset[int] = frozenset()) -> None:
    """Ids with and without special tokens, and decodes, equal to the oracle's on every line not
    in `skip`."""
    lines = fixture["lines"]
    for with_special in (False, True):
        encodings = tokenizer.encode_batch(lines, add_special_tokens=with_special)
        bad = sorted(
            set(mismatched_lines(fixture, [e.ids for e in encodings], with_special)) - skip
        )
        assert not bad, (
            f"{len(bad)}/{len(lines)} lines differ (special tokens: {with_special}), first "
            f"{lines[bad[0]]!r}: {encodings[bad[0]].ids} vs {fixture['ids'][bad[0]]}"
        )
    for n, ids in enumerate(fixture["ids"]):
        decoded = tokenizer.decode([int(i) for i in ids.split()], skip_special_tokens=False)
        assert decoded == fixture["decoded"].get(str(n), lines[n]), lines[n]


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def real_model(request):
    """(model, metadata, fixture, our tokenizer); the fixture must come from this very file."""
    model = REAL_MODELS[request.param]
    path = model.find_file()
    fixture = read_fixture(FIXTURES / model.fixture_name)
    assert sha256_file(path) == fixture["gguf_sha256"], (
        f"{path} is not the file {model.fixture_name} was made from; rerun "
        "tools/gguf_fixtures/tokenizer_ids.py"
    )
    assert len(fixture["lines"]) >= 2000
    metadata = gguf_metadata(path)
    return model, metadata, fixture, build_tokenizer(metadata)


def split_differently(ours, oracle_pre_tokenizer, lines: list[str]) -> frozenset[int]:
    """Lines our pre-tokenizer cuts into other pieces than the oracle's."""
    ours_pre = ours.pre_tokenizer
    return frozenset(
        n
        for n, line in enumerate(lines)
        if [p for p, _ in ours_pre.pre_tokenize_str(line)]
        != [p for p, _ in oracle_pre_tokenizer.pre_tokenize_str(line)]
    )


@pytest.mark.slow
def test_real_model_encodes_and_decodes_as_transformers(real_model):
    model, metadata, fixture, tokenizer = real_model
    assert tokenizer.get_vocab_size() == len(metadata["tokenizer.ggml.tokens"])
    # The lines transformers decodes to other text than they were (none): round trips are exact.
    assert not fixture["decoded"]
    if model.oracle_pre_tokenizer is None:
        assert_matches_fixture(tokenizer, fixture)
        return
    # Where the two pre-tokenizers cut a line alike, the ids agree; everything past the
    # pre-tokenizer (vocabulary, merges, added tokens, decoder) agrees on every line.
    differing = split_differently(tokenizer, model.oracle_pre_tokenizer(), fixture["lines"])
    assert differing  # the corpus does exercise the difference
    assert_matches_fixture(tokenizer, fixture, skip=differing)
    like_oracle = Tokenizer.from_str(tokenizer.to_str())
    like_oracle.pre_tokenizer = model.oracle_pre_tokenizer()
    assert_matches_fixture(like_oracle, fixture)


@pytest.mark.slow
def test_saved_tokenizer_loads_in_transformers_as_built(real_model, tmp_path):
    model, metadata, fixture, tokenizer = real_model
    loaded = save_for_transformers(metadata, tmp_path)
    lines = fixture["lines"]
    for with_special in (False, True):
        ours = [e.ids for e in tokenizer.encode_batch(lines, add_special_tokens=with_special)]
        assert loaded(lines, add_special_tokens=with_special)["input_ids"] == ours
    expected = fixture_ids(fixture, with_special=False)
    for n in range(0, len(lines), 5):
        assert loaded.decode(expected[n]) == fixture["decoded"].get(str(n), lines[n])
    tokens = metadata["tokenizer.ggml.tokens"]
    assert loaded.bos_token == tokens[metadata["tokenizer.ggml.bos_token_id"]]
    assert loaded.eos_token == tokens[metadata["tokenizer.ggml.eos_token_id"]]
    assert loaded.pad_token == tokens[metadata["tokenizer.ggml.padding_token_id"]]
    # The chat template (SmolLM2 has one, Gemma's file none) renders as transformers' GGUF tokenizer's.
    assert len(fixture["chat"]) == (6 if "tokenizer.chat_template" in metadata else 0)
    for chat in fixture["chat"]:
        text = loaded.apply_chat_template(
            chat["messages"], tokenize=False, add_generation_prompt=chat["add_generation_prompt"]
        )
        assert text == chat["text"]
        assert loaded.encode(text, add_special_tokens=False) == chat["ids"]


def test_smollm2_config_and_special_tokens():
    metadata = gguf_metadata(smollm2_gguf())
    assert tokenizer_config(metadata) == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": metadata["tokenizer.chat_template"],
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    tokenizer = build_tokenizer(metadata)
    encoding = tokenizer.encode("<|im_start|>user\n12<|im_end|>", add_special_tokens=False)
    assert encoding.tokens == ["<|im_start|>", "user", "Ċ", "1", "2", "<|im_end|>"]
    # llama.cpp's "smollm" split: digits stand alone, so the run of spaces before one stays whole.
    assert tokenizer.encode("#     10", add_special_tokens=False).tokens == ["#", "ĠĠĠĠĠ", "1", "0"]


def test_gemma3_config_and_special_tokens():
    metadata = gguf_metadata(gemma3_gguf())
    config = tokenizer_config(metadata)
    assert config["bos_token"] == "<bos>" and config["add_bos_token"] is True
    assert "chat_template" not in config and config["model_max_length"] == 32768
    tokenizer = build_tokenizer(metadata)
    encoding = tokenizer.encode("<start_of_turn>user\n\n\nhi", add_special_tokens=True)
    assert encoding.tokens[:3] == ["<bos>", "<start_of_turn>", "user"]
    assert encoding.tokens[3] == "\n\n\n"  # user-defined: kept whole
    # No byte-level alphabet: unseen characters fall back to <0xNN> bytes and decode back.
    text = "\U0001d518\u0000 x"
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=True) == text


# --- tiny GGUF files, oracle live ---------------------------------------------------------------

TINY_TEXT = [
    "Hello world, the theory of the thing is that they think.",
    "  leading spaces and   runs\tand tabs\nand new lines 12345 67",
    "Café déjà vu — 東京 🎉 naïve",
    "<|im_start|>user\nhi there<|im_end|>",
    "don't won't it's THEY'LL",
]


def _tiny_bpe(byte_level: bool):
    """A small BPE trained on TINY_TEXT: (vocab tokens in id order, merges) after the specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if byte_level:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(TINY_TEXT * 20, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [" ".join(pair) for pair in model["merges"]]


def write_tiny_gguf(path: Path, sentencepiece: bool) -> dict:
    """A GGUF with only tokenizer metadata (a vocabulary trained here); returns that metadata."""
    import gguf

    tokens, merges = _tiny_bpe(byte_level=not sentencepiece)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(256)
    if sentencepiece:
        specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        vocab = specials + byte_tokens + [t for t in tokens if t not in specials]
        types = [3] * len(specials) + [6] * 256 + [1] * (len(vocab) - len(specials) - 256)
        types[0] = 2
        scores = [0.0] * (len(specials) + 256) + [
            -float(i) for i in range(len(vocab) - len(specials) - 256)
        ]
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        vocab = specials + tokens
        types = [3] * len(specials) + [1] * len(tokens)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
    writer.add_token_list(vocab)
    writer.add_token_types(types)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_metadata(path)


@pytest.mark.parametrize("sentencepiece", [False, True], ids=["gpt2", "llama"])
def test_tiny_gguf_matches_transformers_and_fixture_round_trips(tmp_path, sentencepiece):
    path = tmp_path / "tiny.gguf"
    metadata = write_tiny_gguf(path, sentencepiece)
    lines = TINY_TEXT + ["", " ", "x", "the  the", " <|im_end|> 0x1F", "ü" * 5]
    fixture = reference_fixture(path, lines)
    assert fixture["lines"] == lines and fixture["gguf_sha256"] == sha256_file(path)
    write_fixture(fixture, tmp_path / "tiny.json.gz")
    assert read_fixture(tmp_path / "tiny.json.gz") == fixture
    assert fixture["special_prefix"] == [
        1
    ]  # BOS: set in the gpt2 file, llama.cpp's default for SPM
    assert_matches_fixture(build_tokenizer(metadata), fixture)
    loaded = save_for_transformers(metadata, tmp_path / "saved")
    assert not mismatched_lines(fixture, loaded(lines)["input_ids"], with_special=True)
    for chat in fixture["chat"]:
        assert (
            loaded.apply_chat_template(
                chat["messages"],
                tokenize=False,
                add_generation_prompt=chat["add_generation_prompt"],
            )
            == chat["text"]
        )
    assert len(fixture["chat"]) == (0 if sentencepiece else 6)


# --- errors ---------------------------------------------------------------------------------------

GOOD = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "smollm",
    "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"],
    "tokenizer.ggml.token_type": [3, 1, 1, 1],
    "tokenizer.ggml.merges": ["a b"],
    "tokenizer.ggml.bos_token_id": 0,
}


def test_good_metadata_builds():
    assert build_tokenizer(GOOD).encode("<s>ab", add_special_tokens=False).ids == [0, 3]


@pytest.mark.parametrize(
    "change, key",
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.pre": "no-such-pre"}, "tokenizer.ggml.pre"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": ["a c"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["a b c"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.token_type": [3, 1, 1]}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.bos_token_id": 4}, "tokenizer.ggml.bos_token_id"),
        (
            {
                "tokenizer.ggml.model": "llama",
                "tokenizer.ggml.merges": None,
                "tokenizer.ggml.scores": [0.0, -1.0],
            },
            "tokenizer.ggml.scores",
        ),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None}, "tokenizer.ggml.scores"),
    ],
)
def test_bad_metadata_raises_model_load_error_naming_the_key(change, key):
    metadata = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.")) as info:
        build_tokenizer(metadata)
    assert "\n" not in str(info.value)


def test_tokenizer_config_checks_the_vocabulary_too():
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.token_type"):
        tokenizer_config({**GOOD, "tokenizer.ggml.token_type": [3]})
