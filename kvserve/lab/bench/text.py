"""Synthetic prompt text as a stream of small pieces (roughly one token each), seeded.

`code` is repetitive, templated Python: easy to predict, so speculative decoding (n-gram or draft)
accepts much of it. `prose` is words drawn independently from a list: hard to predict. docs/load-tests.md
asks every speculative-decoding number to state which one it used.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

CONTENT_TYPES = ("prose", "code")

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river garden window market letter island winter summer village engine bridge "
    "mountain forest signal quiet bright heavy simple early late strong careful ancient "
    "modern sudden gentle narrow open silent walk carry build follow watch listen remember "
    "wonder explain gather travel answer decide notice climb slowly often rarely almost "
    "always never perhaps quickly together outside beneath across toward"
).split()

_VERBS = (
    "compute load parse merge update render build scale filter encode fetch store check".split()
)
_NOUNS = "value item record buffer token block batch score index entry frame cache".split()
_OPS = ("+", "-", "*", "//", "%")

_PIECE_RE = re.compile(r"\s*\S+")


def _prose_sentences(rng: np.random.Generator) -> Iterator[str]:
    while True:
        num_words = int(rng.integers(8, 21))
        words = [_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), size=num_words)]
        words[0] = words[0].capitalize()
        sep = "\n\n" if rng.random() < 0.15 else " "
        yield " ".join(words) + "." + sep


def _code_blocks(rng: np.random.Generator) -> Iterator[str]:
    # One module reuses a few names, as real code does: that repetition is what n-gram and draft
    # proposers exploit.
    verbs = [_VERBS[int(i)] for i in rng.choice(len(_VERBS), size=3, replace=False)]
    nouns = [_NOUNS[int(i)] for i in rng.choice(len(_NOUNS), size=2, replace=False)]
    while True:
        verb = verbs[int(rng.integers(len(verbs)))]
        noun = nouns[int(rng.integers(len(nouns)))]
        op = _OPS[int(rng.integers(len(_OPS)))]
        limit = int(rng.integers(2, 100))
        yield (
            f"def {verb}_{noun}(first_{noun}, second_{noun}):\n"
            f'    """{verb.capitalize()} the {noun} from two inputs."""\n'
            f"    result = first_{noun} {op} second_{noun}\n"
            f"    if result > {limit}:\n"
            f"        return result - {limit}\n"
            f"    return result\n\n\n"
        )


def pieces(content: str, rng: np.random.Generator) -> Iterator[str]:
    """An endless stream of pieces (leading whitespace + one non-space run) whose concatenation is
    text."""
    if content not in CONTENT_TYPES:
        raise ValueError(f"content must be one of {CONTENT_TYPES}, got {content!r}")
    blocks = _code_blocks(rng) if content == "code" else _prose_sentences(rng)
    carry = ""
    for block in blocks:
        text = carry + block
        found = _PIECE_RE.findall(text)
        consumed = sum(len(p) for p in found)
        carry = text[consumed:]  # trailing whitespace joins the next piece
        yield from found


def take_pieces(content: str, rng: np.random.Generator, num_pieces: int) -> list[str]:
    it = pieces(content, rng)
    return [next(it) for _ in range(num_pieces)]
