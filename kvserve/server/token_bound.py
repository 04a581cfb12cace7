"""A lower bound on a text's token count, without tokenising it: so that a prompt far longer than the
context is refused in milliseconds instead of after seconds of tokenisation (a 7 MB prompt took 8 s of
a worker, 1.2 M tokens, before the context check could refuse it).

No token of a tokenizer covers more characters of its input than the longest string in its vocabulary
(added tokens included): a byte-level BPE token's string has one character per byte it covers, a
SentencePiece-style token one per character (`▁` for a space), a byte-fallback token `<0xAB>` six
for one byte. So a text whose normalised form has C characters needs at least ceil(C / L) tokens,
L being that longest length, provided nothing between the text and the model deletes characters.
The bound is built only for tokenizers where that holds (`TokenBound.of` says None otherwise, and the
text is tokenised as before):

- the normaliser is applied as the tokenizer applies it (it may delete: `Replace` with "", NFC
  composing), and must be of a kind that acts on the whole text as on its pieces;
- the pre-tokeniser only splits or maps (ByteLevel, Metaspace, Split and Punctuation that keep what
  they split on, Digits, UnicodeScripts), never removes (Whitespace, BertPreTokenizer and the rest
  are refused);
- the model is BPE, and unknown characters do not fuse into one unknown token (`fuse_unk` without byte
  fallback would let one token cover a whole run of them).

See docs/server.md, "Limits".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# Normalisers that map each piece of text on its own, so normalising the whole text (what this module
# does) never gives more characters than the tokenizer's own, piecewise, normalisation.
_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"})
_KEEPING_BEHAVIOURS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})


def _normalizer_ok(config: dict | None) -> bool:
    if config is None:
        return True
    if config.get("type") == "Sequence":
        return all(_normalizer_ok(item) for item in config.get("normalizers", []))
    return config.get("type") in _NORMALIZERS


def _pre_tokenizer_ok(config: dict | None) -> bool:
    if config is None:
        return True
    kind = config.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_ok(item) for item in config.get("pretokenizers", []))
    if kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts"):
        return True
    if kind in ("Split", "Punctuation"):
        return config.get("behavior", "Isolated") in _KEEPING_BEHAVIOURS
    # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit, ...: they remove characters
    return False


def _model_ok(config: dict) -> bool:
    if config.get("type") != "BPE":
        return False
    return not config.get("fuse_unk") or bool(config.get("byte_fallback"))


@dataclass(frozen=True)
class TokenBound:
    """`at_least(text)`: a number of tokens the text needs at least (see the module doc)."""

    longest_token: int  # characters of the vocabulary's longest string
    normalizer: object | None  # the tokenizer's own (tokenizers.normalizers.Normalizer), or None

    @classmethod
    def of(cls, tokenizer) -> TokenBound | None:
        """The bound for a Hugging Face fast tokenizer, or None where it would not hold."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            config = json.loads(backend.to_str())
            vocab = backend.get_vocab(with_added_tokens=True)
        except Exception:  # noqa: BLE001 (a tokenizer we cannot read: no bound, tokenise as before)
            return None
        if not vocab:
            return None
        if not (
            _normalizer_ok(config.get("normalizer"))
            and _pre_tokenizer_ok(config.get("pre_tokenizer"))
            and _model_ok(config.get("model") or {})
        ):
            return None
        return cls(max(map(len, vocab)), backend.normalizer)

    def at_least(self, text: str, min_chars: int = 0) -> int:
        """A lower bound on `text`'s token count; 0, without normalising, for a text of at most
        `min_chars` characters (the caller passes the length below which the bound could not refuse
        the text, and tokenises such texts)."""
        if len(text) <= min_chars:
            return 0
        if self.normalizer is not None:
            text = self.normalizer.normalize_str(text)
        return math.ceil(len(text) / self.longest_token)
