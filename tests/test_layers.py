"""The layering contract of design.md, checked on the import graph of the source tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "kvserve"

# layer -> packages it must never import (directly; transitive torch freedom is checked below)
FORBIDDEN = {
    "core": {
        "torch",
        "kvserve.kv",
        "kvserve.sched",
        "kvserve.model",
        "kvserve.runner",
        "kvserve.engine",
    },
    "kv": {"torch", "kvserve.sched", "kvserve.model", "kvserve.runner", "kvserve.engine"},
    "sched": {"torch", "kvserve.model", "kvserve.runner", "kvserve.engine"},
    "plan": {"torch", "kvserve.model", "kvserve.runner", "kvserve.engine", "kvserve.server"},
    "runner": {"kvserve.sched", "kvserve.kv"},
    "model": {"kvserve.sched", "kvserve.kv", "kvserve.runner", "kvserve.engine"},
    "bench": {"kvserve.engine", "kvserve.runner", "kvserve.model", "kvserve.sched", "kvserve.kv"},
    "sim": {"torch", "kvserve.model", "kvserve.runner"},
    "engine": {"kvserve.sim"},  # calibration lives beside the simulator (kvserve/calibration.py)
}
# The offline latency bench may use the public LLM API and EngineArgs (design.md).
ALLOWED = {("bench/latency.py", "kvserve.engine")}
ALLOWED_MODULES = {"bench/latency.py": {"kvserve.engine.llm", "kvserve.engine.args"}}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_layer_imports_what_it_must_not():
    violations = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            rel = str(path.relative_to(PACKAGE))
            for name in imports_of(path):
                for bad in forbidden:
                    if not (name == bad or name.startswith(bad + ".")):
                        continue
                    if (rel, bad) not in ALLOWED or name not in ALLOWED_MODULES.get(rel, ()):
                        violations.append(f"{rel} imports {name}")
    assert not violations, "\n".join(violations)


def test_torch_free_layers_do_not_pull_torch_in_transitively():
    modules = []
    for layer in ("core", "kv", "sched", "plan", "sim"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            modules.append("kvserve." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    modules = [m.removesuffix(".__init__") for m in modules] + ["kvserve.config", "kvserve"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules)
    code += "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\nprint(bad)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
