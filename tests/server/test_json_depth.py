"""The body's nesting check (kvserve/server/limits.py `json_depth`): exact against a recursive count
over random documents whose strings hold brackets, quotes and backslashes, and linear on the body
fuzzing found quadratic (an unclosed string of escaped quotes)."""

from __future__ import annotations

import json
import random

from kvserve.server.limits import json_depth

PIECES = ['a"b', "\\", "[{", '}]\\"', "x\\\\", 1, None, '\\\\"[[[', "\u00e9]"]


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


def _document(rng: random.Random, level: int = 0):
    r = rng.random()
    if level > 70 or r < 0.3:
        return rng.choice(PIECES)
    if r < 0.65:
        return [_document(rng, level + 1) for _ in range(rng.randint(0, 3))]
    keys = (rng.choice(["k", "[", '"}', "\\"]) + str(i) for i in range(rng.randint(0, 3)))
    return {k: _document(rng, level + 1) for k in keys}


def test_the_depth_is_exact_with_brackets_quotes_and_backslashes_inside_strings():
    rng = random.Random(0)
    for _ in range(500):
        doc = _document(rng)
        for body in (json.dumps(doc).encode(), json.dumps(doc, ensure_ascii=False).encode()):
            assert json_depth(body, 0) == _depth(doc), body[:200]


def test_an_unclosed_string_of_escaped_quotes_is_linear():
    # a regex over strings restarted at every escaped quote: 12 s at 48 KB, ~4x per doubling;
    # this 4 MB body would take hours that way (the suite's timeout fails it)
    body = b"[" * 65 + b'"' + b'\\"' * 2_000_000
    assert json_depth(body, 64) == 65
    assert json_depth(b"[" * 65 + b'"\\\\"' + b"]" * 65, 64) == 65  # an escaped backslash closes
