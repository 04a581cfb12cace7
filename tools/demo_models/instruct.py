"""Step 2b: instruction pairs made from the training corpus, for the short instruction-tuning stage.

Every pair comes from the train split only (never the held-out documents), rendered with the chat
template and ended by `<|end|>`, so the tuned model answers a request and then stops:

  docstring -> function   "Write a Python function that returns ..." -> the stdlib function's source
  question  -> topic      "What is <language-reference topic>?"       -> the topic's opening paragraphs
  question  -> docstring  "What does the <module> module do?" / "What does <name>() do?" -> docstring

Writes work/tokens/train_sft.bin (uint16, the rendered pairs in a seeded order) and
work/corpus/train_sft.jsonl (the pairs as text), and prints counts per kind.

    python -m tools.demo_models.instruct [--max-answer-chars 1200]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tools.demo_models.common import EOS_TOKEN, SEED
from tools.demo_models.corpus import CORPUS_DIR
from tools.demo_models.tokenizer import TOKENIZER_DIR, TOKENS_DIR, read_documents

MAX_FUNCTION_LINES = 30
CODE_REQUESTS = (
    "Write a Python function that {task}.",
    "Write a function that {task}.",
    "Write Python code that {task}.",
    "Implement a Python function that {task}.",
)
TOPIC_QUESTIONS = ("What is {topic}?", "Explain {topic} in Python.", "Tell me about {topic}.")
# Imperative first words of docstrings, turned third person ("Return" -> "returns").
VERBS = {
    "return",
    "compute",
    "convert",
    "create",
    "get",
    "set",
    "add",
    "make",
    "build",
    "check",
    "test",
    "find",
    "read",
    "write",
    "parse",
    "format",
    "remove",
    "delete",
    "update",
    "open",
    "close",
    "send",
    "load",
    "save",
    "call",
    "run",
    "generate",
    "encode",
    "decode",
    "split",
    "join",
    "copy",
    "move",
    "print",
    "count",
    "calculate",
    "extract",
    "strip",
    "replace",
    "append",
    "insert",
    "clear",
    "determine",
    "raise",
    "handle",
    "process",
    "register",
    "translate",
    "wrap",
    "escape",
    "normalize",
    "initialize",
    "reset",
    "yield",
    "iterate",
    "search",
    "match",
    "compare",
    "sort",
    "merge",
    "quote",
    "unquote",
    "validate",
    "apply",
}


def third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def task_from_docstring(doc: str) -> str | None:
    """'Return the sum of a and b.' -> 'returns the sum of a and b'; None when not imperative."""
    line = doc.strip().splitlines()[0].strip().rstrip(".")
    words = line.split()
    if len(words) < 3 or len(line) > 120 or not words[0][:1].isupper():
        return None
    if words[0].lower() not in VERBS:
        return None
    return " ".join([third_person(words[0].lower()), *words[1:]])


def first_paragraphs(text: str, max_chars: int) -> str:
    """Whole paragraphs from the start of `text`, at most `max_chars` (at least the first one)."""
    out = ""
    for para in text.split("\n\n"):
        if out and len(out) + len(para) + 2 > max_chars:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[: max_chars * 2].strip()


def function_pairs(source: str, rng: random.Random) -> Iterator[tuple[str, str, str]]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    for node in tree.body:  # module-level functions: self-contained answers
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        task = task_from_docstring(doc) if doc else None
        if task is None or node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        body = "\n".join(lines[start - 1 : node.end_lineno])
        for template in rng.sample(CODE_REQUESTS, 2):  # two phrasings: code is the rarer kind
            yield "code", template.format(task=task), body


def docstring_pairs(source: str, module: str, max_chars: int) -> Iterator[tuple[str, str, str]]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= 80:
        yield "docstring", f"What does the {module} module do?", first_paragraphs(doc, max_chars)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:
                call = f"{node.name}()" if isinstance(node, ast.FunctionDef) else node.name
                question = f"What does {module}.{call} do?"
                yield "docstring", question, first_paragraphs(doc, max_chars)


def topic_pairs(doc: dict, max_chars: int) -> Iterator[tuple[str, str, str]]:
    heading, _, rest = doc["text"].partition("\n")
    heading = heading.strip()
    rest = rest.lstrip("*\n").strip()
    if not heading or not rest:
        return
    topic = heading[0].lower() + heading[1:] if heading[1:2].islower() else heading
    answer = first_paragraphs(rest, max_chars)
    for template in TOPIC_QUESTIONS:
        yield "topic", template.format(topic=topic), answer


def build_pairs(corpus_dir: Path, max_chars: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    pairs: list[tuple[str, str, str]] = []
    for doc in read_documents(corpus_dir, "train", "code"):
        module = doc["id"].removeprefix("stdlib/").removesuffix(".py").removesuffix("/__init__")
        module = module.replace("/", ".")
        pairs += function_pairs(doc["text"], rng)
        pairs += docstring_pairs(doc["text"], module, max_chars)
    for doc in read_documents(corpus_dir, "train", "prose"):
        if doc["source"] == "python-docs-topics":
            pairs += topic_pairs(doc, max_chars)
    rng.shuffle(pairs)
    return [{"kind": k, "user": q, "assistant": a} for k, q, a in pairs]


def render(pair: dict) -> str:
    return (
        f"<|bos|><|user|>\n{pair['user']}{EOS_TOKEN}\n"
        f"<|assistant|>\n{pair['assistant']}{EOS_TOKEN}\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="corpus directory")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR, help="tokenizer directory")
    parser.add_argument("--tokens-out", type=Path, default=TOKENS_DIR, help="token array directory")
    parser.add_argument("--max-answer-chars", type=int, default=1200, help="answer length cap")
    parser.add_argument("--seed", type=int, default=SEED, help="order and template choice")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer

    pairs = build_pairs(args.corpus, args.max_answer_chars, args.seed)
    with open(args.corpus / "train_sft.jsonl", "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair) + "\n")
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    encoded = tok.encode_batch([render(p) for p in pairs], add_special_tokens=False)
    ids = np.concatenate([np.asarray(e.ids, dtype=np.uint16) for e in encoded])
    args.tokens_out.mkdir(parents=True, exist_ok=True)
    ids.tofile(args.tokens_out / "train_sft.bin")
    counts: dict[str, int] = {}
    for pair in pairs:
        counts[pair["kind"]] = counts.get(pair["kind"], 0) + 1
    print(json.dumps({"pairs": counts, "tokens": int(ids.size)}))


if __name__ == "__main__":
    main()
