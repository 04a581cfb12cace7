"""kvserve.gguf.tokenizer against transformers' own GGUF tokenizer conversion (the oracle).

For the two real models the oracle's ids come from committed fixtures (tools/gguf_fixtures/
tokenizer_ids.py; converting Gemma's vocabulary in transformers takes about a minute); for tiny
GGUF files written here the oracle runs live, through the same fixture code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.core.errors import ModelLoadError
from kvserve.gguf.tokenizer import build_tokenizer, tokenizer_config
from kvserve.paths import sha256_file
from tests.real_models import gemma3_gguf, gguf_metadata, smollm2_gguf
from tools.gguf_fixtures.tokenizer_ids import read_fixture, reference_fixture, write_fixture

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_tokenizer"
REAL_MODELS = {"smollm2": (smollm2_gguf, "smollm2-135m-instruct.json.gz"),
               "gemma3": (gemma3_gguf, "gemma-3-270m.json.gz")}


def save_for_transformers(metadata: dict, directory: Path):
    """What kvserve writes beside a GGUF, loaded back with `AutoTokenizer`."""
    from transformers import AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(metadata).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata)))
    return AutoTokenizer.from_pretrained(str(directory))


def mismatched_lines(fixture: dict, ids_per_line: list[list[int]], with_special: bool) -> list[int]:
    prefix, suffix = (fixture["special_prefix"], fixture["special_suffix"]) if with_special else ([], [])
    expected = [prefix + [int(i) for i in ids.split()] + suffix for ids in fixture["ids"]]
    return [n for n, (got, want) in enumerate(zip(ids_per_line, expected, strict=True)) if got != want]


def assert_matches_fixture(tokenizer, fixture: dict) -> None:
    """Ids with and without special tokens, and decodes, all equal to the oracle's, line by line."""
    lines = fixture["lines"]
    for with_special in (False, True):
        encodings = tokenizer.encode_batch(lines, add_special_tokens=with_special)
        bad = mismatched_lines(fixture, [e.ids for e in encodings], with_special)
        assert not bad, (
            f"{len(bad)}/{len(lines)} lines differ (special tokens: {with_special}), first "
            f"{lines[bad[0]]!r}: {encodings[bad[0]].ids} vs {fixture['ids'][bad[0]]}"
        )
    for n, ids in enumerate(fixture["ids"]):
        decoded = tokenizer.decode([int(i) for i in ids.split()], skip_special_tokens=False)
        assert decoded == fixture["decoded"].get(str(n), lines[n]), lines[n]


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def real_model(request):
    """(metadata, fixture) of one real model; the fixture must have been made from this very file."""
    find_file, fixture_name = REAL_MODELS[request.param]
    path = find_file()
    fixture = read_fixture(FIXTURES / fixture_name)
    assert sha256_file(path) == fixture["gguf_sha256"], (
        f"{path} is not the file {fixture_name} was made from; rerun tools/gguf_fixtures/tokenizer_ids.py"
    )
    return gguf_metadata(path), fixture


@pytest.mark.slow
def test_real_model_encodes_and_decodes_as_transformers(real_model):
    metadata, fixture = real_model
    assert len(fixture["lines"]) >= 2000
    tokenizer = build_tokenizer(metadata)
    assert tokenizer.get_vocab_size() == len(metadata["tokenizer.ggml.tokens"])
    assert_matches_fixture(tokenizer, fixture)
    # Round trip: what the oracle decodes back differently (none today) we do too; the rest is exact.
    assert not fixture["decoded"]


@pytest.mark.slow
def test_saved_tokenizer_loads_in_transformers_like_its_gguf_conversion(real_model, tmp_path):
    metadata, fixture = real_model
    loaded = save_for_transformers(metadata, tmp_path)
    lines = fixture["lines"]
    for with_special in (False, True):
        ids = loaded(lines, add_special_tokens=with_special)["input_ids"]
        assert not mismatched_lines(fixture, ids, with_special)
    for n in range(0, len(lines), 7):
        ids = [int(i) for i in fixture["ids"][n].split()]
        assert loaded.decode(ids) == fixture["decoded"].get(str(n), lines[n])
    for chat in fixture["chat"]:
        text = loaded.apply_chat_template(
            chat["messages"], tokenize=False, add_generation_prompt=chat["add_generation_prompt"]
        )
        assert text == chat["text"]
        assert loaded.encode(text, add_special_tokens=False) == chat["ids"]
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id"}
    for name, key in names.items():
        assert getattr(loaded, name) == metadata["tokenizer.ggml.tokens"][metadata[f"tokenizer.ggml.{key}"]]


def test_smollm2_chat_template_and_config(tmp_path):
    metadata = gguf_metadata(smollm2_gguf())
    fixture = read_fixture(FIXTURES / REAL_MODELS["smollm2"][1])
    assert len(fixture["chat"]) == 6
    config = tokenizer_config(metadata)
    assert config == {
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
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids[0] == 1
    # llama.cpp splits every digit for pre "smollm"; transformers only by GPT-2's regex. The
    # vocabulary has no merge that could join a digit to anything, so both give one id per digit.
    assert tokenizer.encode(" 2026", add_special_tokens=False).tokens == ["Ġ", "2", "0", "2", "6"]


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
        scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(vocab) - len(specials) - 256)]
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
    assert fixture["special_prefix"] == [1]  # BOS: set in the gpt2 file, llama.cpp's default for SPM
    assert_matches_fixture(build_tokenizer(metadata), fixture)
    loaded = save_for_transformers(metadata, tmp_path / "saved")
    assert not mismatched_lines(fixture, loaded(lines)["input_ids"], with_special=True)
    for chat in fixture["chat"]:
        assert loaded.apply_chat_template(chat["messages"], tokenize=False,
                                          add_generation_prompt=chat["add_generation_prompt"]) == chat["text"]
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
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None,
          "tokenizer.ggml.scores": [0.0, -1.0]}, "tokenizer.ggml.scores"),
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
