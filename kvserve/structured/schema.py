"""What each structured-output constraint compiles to (docs/structured-output.md): the checks that
refuse a JSON schema the grammar cannot enforce, and the one xgrammar compile call per constraint
kind. Torch-free: the compile worker process (compile_worker.py) runs `compile_constraint`."""

from __future__ import annotations

import json

# Keywords whose values are data, not schemas: a "pattern" key inside them is not a pattern.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: a name there ("default", "enum") is not a keyword.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def lookahead_at(pattern: str) -> int | None:
    """Index of the first lookahead group, `(?=` or `(?!`, in a regex; None without one. Escaped characters
    and character classes (`[(?=]`) do not count."""
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "]":  # a "]" first in a class is a literal
                i += 1
        elif pattern.startswith(("(?=", "(?!"), i):
            return i
        i += 1
    return None


def refuse_unenforceable_schema(node: object, path: str = "") -> None:
    """Raise ValueError for what xgrammar 0.2.9 would compile into a grammar that does not enforce the
    schema, so that the output would fail the client's own validation:
    - a `pattern` (or `patternProperties` key) with a lookahead: compiled with the lookahead dropped,
      so `(?!x).` would let "x" through (its `regex` constraint refuses them, and so do we);
    - a `$ref` that is not local (`#` or `#/...`): an external document is never fetched, and
      xgrammar only logs a warning and lets that value be any JSON."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            refuse_unenforceable_schema(item, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        raise ValueError(
            f"the $ref {ref!r} at {path or '/'} is not local: structured output resolves only "
            "references into the schema itself ('#' or '#/...'); put the definition in $defs"
        )
    patterns = (
        [(f"{path}/pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
    )
    if isinstance(node.get("patternProperties"), dict):
        patterns += [(f"{path}/patternProperties", key) for key in node["patternProperties"]]
    for where, pattern in patterns:
        at = lookahead_at(pattern)
        if at is not None:
            raise ValueError(
                f"the pattern {pattern!r} at {where or '/'} has a lookahead at position {at}, which "
                "structured output cannot enforce"
            )
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, schema in value.items():
                refuse_unenforceable_schema(schema, f"{path}/{key}/{name}")
        elif key not in _DATA_KEYWORDS:
            refuse_unenforceable_schema(value, f"{path}/{key}")


def compile_constraint(compiler, kind: str, spec: str):
    """Compile one constraint with an xgrammar `GrammarCompiler` (run in a compile worker process)."""
    if kind == "json_object":  # OpenAI's JSON mode: an object, whatever its keys
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
    if kind == "json_schema":
        refuse_unenforceable_schema(json.loads(spec))
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":  # xgrammar's format JSON (forced tool calls, docs/tools.md)
        refuse_unenforceable_schema(json.loads(spec))  # the tools' parameter schemas
        return compiler.compile_structural_tag(spec)
    if kind == "choice":
        choices = json.loads(spec)
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
        return compiler.compile_grammar(f"root ::= ({alternatives})")
    raise ValueError(f"unknown constraint kind {kind!r}")
