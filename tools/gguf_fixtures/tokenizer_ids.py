"""Reference token ids from transformers' own GGUF tokenizer conversion, saved as a test fixture.

transformers rebuilds a GGUF vocabulary in Python (about a minute for Gemma's 262k tokens), too slow
for CI; this records what it produces once, and tests/gguf/test_gguf_tokenizer.py compares
`kvserve.gguf.tokenizer` against the record:

    python -m tools.gguf_fixtures.tokenizer_ids MODEL.gguf tests/fixtures/gguf_tokenizer/NAME.json.gz

The fixture (gzip JSON) holds the corpus lines themselves, their ids without special tokens, the ids
transformers adds around them with special tokens (checked to be the same for every line), decodes
that differ from the line, and chat-template renders when the file has a template.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from kvserve.paths import sha256_file
from tools.gguf_fixtures.corpus import corpus_lines

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 日本"},
    ],
    [
        {"role": "user", "content": "Write `x = 1`\n\tthen   spaces"},
        {"role": "assistant", "content": "<|im_end|> is literal text here 🎉"},
    ],
]


def reference_fixture(gguf_path: Path, lines: list[str]) -> dict:
    """What transformers' GGUF tokenizer makes of `lines` (and of `CONVERSATIONS`, given a template)."""
    import tokenizers
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    ids = [reference.encode(line, add_special_tokens=False) for line in lines]
    prefix, suffix = _special_affixes(reference, lines, ids)
    decoded = {}
    for index, line_ids in enumerate(ids):
        text = reference.decode(line_ids)
        if text != lines[index]:
            decoded[str(index)] = text
    fixture = {
        "gguf": gguf_path.name,
        "gguf_sha256": sha256_file(gguf_path),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "lines": lines,
        "ids": [" ".join(map(str, line_ids)) for line_ids in ids],
        "special_prefix": prefix,
        "special_suffix": suffix,
        "decoded": decoded,
        "chat": [],
    }
    if reference.chat_template:
        for messages in CONVERSATIONS:
            for add_generation_prompt in (False, True):
                text = reference.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt
                )
                fixture["chat"].append(
                    {
                        "messages": messages,
                        "add_generation_prompt": add_generation_prompt,
                        "text": text,
                        "ids": reference.encode(text, add_special_tokens=False),
                    }
                )
    return fixture


def _special_affixes(
    reference, lines: list[str], ids: list[list[int]]
) -> tuple[list[int], list[int]]:
    """The ids `add_special_tokens=True` puts before and after every line (the same for all).

    A line's own ids may start or end with the BOS/EOS id, so each line admits several splits of
    its full encoding; exactly one split must fit every line."""
    common: set[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    for line, line_ids in zip(lines, ids, strict=True):
        full = reference.encode(line, add_special_tokens=True)
        num_extra = len(full) - len(line_ids)
        splits = {
            (tuple(full[:start]), tuple(full[start + len(line_ids) :]))
            for start in range(num_extra + 1)
            if full[start : start + len(line_ids)] == line_ids
        }
        common = splits if common is None else common & splits
    if not common or len(common) != 1:
        raise AssertionError(f"no single set of special tokens fits every line: {common}")
    prefix, suffix = common.pop()
    return list(prefix), list(suffix)


def write_fixture(fixture: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(fixture, ensure_ascii=False, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))


def read_fixture(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--num-lines", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fixture = reference_fixture(args.gguf, corpus_lines(args.num_lines, args.seed))
    write_fixture(fixture, args.out)
    num_tokens = sum(len(ids.split()) for ids in fixture["ids"])
    print(
        f"{args.out}: {len(fixture['lines'])} lines, {num_tokens} tokens, {args.out.stat().st_size} bytes"
    )


if __name__ == "__main__":
    main()
