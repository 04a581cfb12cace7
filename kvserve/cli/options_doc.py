"""docs/options.md, generated: every `kvserve serve` option (flag, name, type with its bound,
default, help) from the declarations (kvserve/core/options.py). tests/cli/test_options.py fails when the
file and the declarations differ; `python -m kvserve.cli.options_doc --write docs/options.md`
regenerates it."""

from __future__ import annotations

import sys
from pathlib import Path

from kvserve.core.options import groups_of, markdown_table
from kvserve.engine.args import EngineArgs
from kvserve.server.args import ServeArgs
from kvserve.server.limits import RequestLimits
from kvserve.server.serving import ServingOptions

DOCS_PATH = "docs/options.md"
REGENERATE = f"python -m kvserve.cli.options_doc --write {DOCS_PATH}"
_SECTIONS = (
    (
        ServeArgs,
        "Server",
        "The server process: where it listens, who may call it, how it starts and stops.",
    ),
    (ServingOptions, "Requests", "How requests are served (`ServingOptions`)."),
    (
        RequestLimits,
        "Request limits",
        'What one request may ask for (`RequestLimits`; docs/server.md, "Limits").',
    ),
    (
        EngineArgs,
        "Engine",
        "The engine's options: `kvserve serve`, `kvserve generate`, `kvserve bench latency` and "
        "`kvserve tp-node` take them as flags, `LLM(model, **options)` as keyword arguments (the "
        "name column).",
    ),
)


def options_markdown() -> str:
    """docs/options.md: every `kvserve serve` option (flag, name, type with its bound, default,
    help) as Markdown tables, generated from the declarations."""
    parts = [
        "# kvserve serve options\n",
        f"Generated from the option declarations (kvserve/core/options.py); do not edit by hand: "
        f"`{REGENERATE}`.\n",
        "A value out of its bound is refused at start-up, naming the flag "
        "(`--max-n must be >= 1, got 0`); the same bound refuses it in the Python API.\n",
    ]
    for cls, title, intro in _SECTIONS:
        parts.append(f"## {title}\n\n{intro}\n")
        for group in groups_of(cls):
            if group is not None:
                parts.append(f"### {group[0].upper()}{group[1:]}\n")
            parts.append(markdown_table(cls, group))
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    """`python -m kvserve.cli.options_doc [--write PATH]`: print docs/options.md, or write it."""
    text = options_markdown()
    if argv[:1] == ["--write"] and len(argv) == 2:
        Path(argv[1]).write_text(text, encoding="utf-8")
    elif argv:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
