"""The lower bound on a text's token count (kvserve/server/token_bound.py): never above the real count, on
byte-level and SentencePiece-style tokenizers and hostile texts; refused where characters may vanish."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvserve.server.token_bound import TokenBound
from tests import REPO_ROOT
from tests.checkpoints import GPT2_TOKENIZER

DEMO = REPO_ROOT / "kvserve" / "assets" / "demo" / "target"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé — déjà vu. 東京タワー 你好世界 🙂🚀",
    "def f(x):\n    return x * 2  # comment\n\n\n",
] * 20


def _fast(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral's layout: Prepend + Replace normalisers, BPE with byte fallback, fused unk."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", *byte_tokens]),
    )
    return _fast(tok)


def gpt2_with(normalizer_config: dict | None, pre_tokenizer_config: dict | None = None):
    """GPT-2's tokenizer with its normaliser (and pre-tokeniser) replaced, as Qwen2 sets NFC."""
    config = json.loads((GPT2_TOKENIZER / "tokenizer.json").read_text())
    config["normalizer"] = normalizer_config
    if pre_tokenizer_config is not None:
        config["pre_tokenizer"] = pre_tokenizer_config
    return _fast(Tokenizer.from_str(json.dumps(config)))


def hostile_texts(longest: str) -> list[str]:
    rng = random.Random(0)
    alphabet = (
        "ab ,.\n\t-"
        + "éüß"
        + "\u0301\u0308"
        + "東京你"
        + "🙂🚀"
        + "\u200b\ufeff"
        + "\x00\x7f"
        + "ᄀ하"
    )
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(40)]
    texts += [
        "-" * 20_000,  # runs that merge into the longest tokens
        " " * 20_000,
        "=" * 5_000 + "\n" * 5_000,
        "<|endoftext|>" * 2_000,  # an added token, matched before the model
        "<s>" * 3_000,
        longest * 500,
        "e\u0301" * 5_000,  # NFC composes each pair into one character
        "word " * 30_000,
    ]
    return texts


TOKENIZERS = {
    "gpt2": lambda: AutoTokenizer.from_pretrained(GPT2_TOKENIZER),
    "demo": lambda: AutoTokenizer.from_pretrained(DEMO),
    "sentencepiece-style": sentencepiece_style,
    "gpt2-nfc": lambda: gpt2_with({"type": "NFC"}),
    "gpt2-nfkc-lowercase": lambda: gpt2_with(
        {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}
    ),
}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_bound_never_exceeds_the_real_count(name):
    tokenizer = TOKENIZERS[name]()
    bound = TokenBound.of(tokenizer)
    assert bound is not None, name
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    assert bound.longest_token == len(longest)
    readable = tokenizer.convert_tokens_to_string([longest])
    for text in hostile_texts(readable):
        count = len(tokenizer.encode(text, add_special_tokens=False))
        at_least = bound.at_least(text)
        assert at_least <= count, (name, text[:40], at_least, count)
    # and it is a bound worth having: a long text is shown to need many tokens
    assert bound.at_least("word " * 30_000) >= 150_000 // bound.longest_token


def test_short_texts_are_left_to_the_tokenizer():
    bound = TokenBound.of(AutoTokenizer.from_pretrained(GPT2_TOKENIZER))
    assert bound.at_least("x" * 1000, 1000) == 0
    assert bound.at_least("x" * 1001, 1000) == 8  # ceil(1001 / 128)


def test_the_normaliser_is_applied_before_counting():
    """A normaliser that deletes (Replace with "") shrinks the text the model sees: the bound counts
    what is left, not what was sent."""
    bound = TokenBound.of(gpt2_with({"type": "Replace", "pattern": {"String": "z"}, "content": ""}))
    assert bound is not None
    assert bound.at_least("z" * 100_000) == 0
    assert bound.at_least("z" * 100_000 + "a") == 1


@pytest.mark.parametrize(
    "normalizer, pre_tokenizer",
    [
        ({"type": "Strip", "strip_left": True, "strip_right": True}, None),  # strips each piece
        ({"type": "StripAccents"}, None),  # removes combining marks
        (
            {
                "type": "BertNormalizer",
                "clean_text": True,
                "handle_chinese_chars": True,
                "strip_accents": None,
                "lowercase": True,
            },
            None,
        ),
        (None, {"type": "Whitespace"}),  # drops the whitespace it splits on
        (
            None,
            {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},
        ),
        (None, {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}]}),
    ],
)
def test_tokenizers_that_may_drop_characters_get_no_bound(normalizer, pre_tokenizer):
    assert TokenBound.of(gpt2_with(normalizer, pre_tokenizer)) is None


def test_models_whose_one_token_may_cover_any_run_get_no_bound():
    """WordPiece's [UNK] covers a whole word; BPE that fuses unknown characters without byte
    fallback covers a whole run of them with one token."""
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert TokenBound.of(_fast(wordpiece)) is None
    fused = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert TokenBound.of(_fast(fused)) is None
    fused_text = "€" * 10_000  # one token for all of it
    assert len(fused.encode(fused_text).ids) == 1
    assert TokenBound.of(object()) is None  # a slow tokenizer: no backend to read
