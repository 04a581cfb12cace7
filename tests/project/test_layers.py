"""The layering contract of docs/design.md ("Layers"), checked on the import graph of the source.

Every package and every module at the package root belongs to a layer, and each layer lists the
layers it may import: an import of anything else fails, wherever it stands (module level or inside
a function: tests/import_graph.py). A few single modules cross a line on purpose; they are listed in
EXCEPTIONS with the reason, and docs/design.md names them too.
"""

from __future__ import annotations

import subprocess
import sys

from tests.import_graph import imports, modules

# layer -> the layers it may import (its own always). A layer is a package (`kvserve.quant`) or a
# module at the package root (`kvserve.memory`); `kvserve` is the package's __init__.
LEAVES = ("_version", "paths", "progress", "options", "mp_children", "threads")
MAY_IMPORT: dict[str, set[str]] = {
    **{leaf: set() for leaf in LEAVES},
    "core": set(),
    "kv": {"core"},
    "config": {"core", "kv", "quant", "gguf"},  # torch-free modules of quant and gguf only: below
    "sched": {"core", "kv", "config"},
    "plan": {"core", "kv", "config", "paths", "quant"},
    "evaluation": {"core"},
    "links": {"core"},  # authenticated links between hosts (TP nodes, remote engine cores)
    "gguf": {"core", "paths", "model"},  # model.block_weights only: below
    "models": {"core", "gguf"},
    "tokenizer": {"core", "config"},
    "memory": {"gguf"},
    "structured": {"core", "mp_children"},
    "quant": {"core", "gguf", "paths", "progress", "evaluation", "tokenizer"},
    "model": {"core", "config", "gguf", "quant", "paths", "progress"},
    "runner": {
        *("core", "config", "model", "quant", "structured", "threads", "mp_children", "paths"),
        "links",
    },
    "engine": set(
        "core config kv sched model runner quant structured tokenizer memory models options threads "
        "mp_children paths progress gguf links".split()
    ),
    "server": {"core", "engine", "quant", "paths", "kvserve", "_version"},
    "bench": {"core", "plan", "options", "models", "_version", "paths", "progress"},
    "check": {"core", "bench", "options", "_version"},
    "sim": {"core", "config", "kv", "sched", "plan", "bench", "engine", "paths"},
    # the measurement lab at the package root: the engine's public API and its model internals
    "measure": {"plan"},
    "measure_engine": {"config", "measure", "model", "plan", "quant"},
    "measure_forward": {"config", "measure", "model"},
    "measure_pool": {"measure", "measure_engine", "model", "plan", "quant"},
    "measure_overhead": {"core", "engine", "plan", "runner"},
    "calibration": {"core", "config", "engine", "sim"},
    "kvserve": {"_version", "core", "engine", "threads"},
    "lab": set(),  # kvserve/lab/__init__.py: the lab's door, imports nothing
    "cli": set(),  # the command line: filled in below with every layer
    "__main__": {"cli"},
}
MAY_IMPORT["cli"] = set(MAY_IMPORT) - {"__main__"}

# (importing module or package prefix, imported module prefix): the lines a module may cross.
EXCEPTIONS = {
    # the offline latency bench uses the public LLM API and EngineArgs (docs/design.md)
    ("kvserve.lab.bench.latency", "kvserve.engine.llm"),
    ("kvserve.lab.bench.latency", "kvserve.engine.args"),
    # `kvserve quantize` reads the float checkpoint through the model's loader
    ("kvserve.quant.pipeline", "kvserve.model.loader"),
    # `kvserve eval compare` runs both models through the LLM API (lab code)
    ("kvserve.quant.compare", "kvserve.engine.llm"),
    # the simulator replays the engine's step log format (docs/simulator.md)
    ("kvserve.lab.sim.delivery", "kvserve.engine.step_log"),
}
# Inside an allowed layer, only these modules: the rest of that layer is above the importer.
ONLY = {
    "config": {
        "quant": ("kvserve.quant.scheme", "kvserve.quant.methods"),
        "gguf": ("kvserve.gguf.source",),  # what a GGUF model directory points at (json only)
    },
    "plan": {"quant": ("kvserve.quant.scheme",)},  # the one reader of format strings
    "gguf": {"model": ("kvserve.model.block_weights",)},
    "server": {
        "engine": (
            "kvserve.engine.client",
            "kvserve.engine.output_processor",
            "kvserve.engine.wire",
            "kvserve.engine.outputs",
        ),
        "quant": ("kvserve.quant.provenance", "kvserve.quant.methods", "kvserve.quant.scheme"),
    },
    "sim": {"engine": ("kvserve.engine.step_log",)},
}
# Layers that never import torch or transformers, not even inside a function.
TORCH_FREE = {
    *"core kv sched plan config sim check server evaluation models tokenizer links".split(),
    *LEAVES,
}
# Single torch-free modules inside a torch layer, which torch-free code imports.
TORCH_FREE_MODULES = (
    "kvserve.quant.scheme",
    "kvserve.quant.methods",
    "kvserve.quant.provenance",
    "kvserve.structured.schema",
)


def layer_of(module: str) -> str:
    """`kvserve.x...` is layer x; inside the lab (`kvserve.lab.x...`) each package or module is a
    layer of its own (bench, plan, sim, check, the measure modules, calibration)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "lab":
        return parts[2]
    return parts[1] if len(parts) > 1 else "kvserve"


def _excepted(module: str, target: str) -> bool:
    return any(
        (module == a or module.startswith(a + ".")) and (target == b or target.startswith(b + "."))
        for a, b in EXCEPTIONS
    )


def test_every_module_belongs_to_a_layer():
    missing = sorted({layer_of(m) for m in modules()} - set(MAY_IMPORT))
    assert not missing, (
        f"layers with no rule (add them to MAY_IMPORT and docs/design.md): {missing}"
    )


def test_no_layer_imports_what_it_must_not():
    violations = []
    for imp in imports():
        if not imp.target.startswith("kvserve"):
            continue
        src, dst = layer_of(imp.module), layer_of(imp.target)
        if src == dst or _excepted(imp.module, imp.target):
            continue
        only = ONLY.get(src, {}).get(dst)
        allowed = dst in MAY_IMPORT[src] and (only is None or imp.target in only)
        if not allowed:
            path = modules()[imp.module].relative_to(modules()["kvserve"].parent.parent)
            violations.append(f"{path}:{imp.line} imports {imp.target}")
    assert not violations, "\n".join(sorted(set(violations)))


def test_torch_free_layers_never_import_torch():
    bad = []
    for imp in imports():
        torch_free = layer_of(imp.module) in TORCH_FREE or imp.module in TORCH_FREE_MODULES
        if torch_free and imp.target in ("torch", "transformers", "safetensors"):
            if imp.module == "kvserve.tokenizer" and imp.target == "transformers":
                continue  # loads a tokenizer on request, never at import (docs/design.md)
            bad.append(f"{imp.module}:{imp.line} imports {imp.target}")
    assert not bad, "\n".join(sorted(bad))


def test_torch_free_layers_do_not_pull_torch_in_transitively():
    names = [
        m
        for m in modules()
        if layer_of(m) in TORCH_FREE - {"server", "tokenizer"} and layer_of(m) != "kvserve"
    ]
    names += [*TORCH_FREE_MODULES, "kvserve.tokenizer", "kvserve"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in sorted(names))
    code += "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\nprint(bad)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_rules_can_fail():
    """A rule that cannot fail is a defect: the engine importing the simulator would be caught."""
    assert "sim" not in MAY_IMPORT["engine"] and "server" not in MAY_IMPORT["engine"]
    assert "torch" not in MAY_IMPORT["core"] and "core" in TORCH_FREE
    assert not _excepted("kvserve.engine.core", "kvserve.lab.sim.loop")


def test_nothing_but_the_command_line_imports_the_lab():
    """The lab (kvserve/lab) stands beside the engine: the engine, the server and every other layer
    never import it; only `kvserve bench|plan|simulate|check` do."""
    bad = []
    for imp in imports():
        if imp.target.startswith("kvserve.lab") and not imp.module.startswith("kvserve.lab"):
            if layer_of(imp.module) not in ("cli", "__main__"):
                bad.append(f"{imp.module}:{imp.line} imports {imp.target}")
    assert not bad, "\n".join(sorted(bad))


def test_the_lab_uses_no_private_name_of_the_engine():
    """What the lab takes from the rest of kvserve is public: no `_name` imported from outside it."""
    import ast

    root = modules()["kvserve"].parent.parent
    bad = []
    for name, path in modules().items():
        if not name.startswith("kvserve.lab"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                outside = node.module.startswith("kvserve") and not node.module.startswith(
                    "kvserve.lab"
                )
                private = [a.name for a in node.names if a.name.startswith("_")]
                if outside and private and node.module != "kvserve._version":
                    bad.append(f"{path.relative_to(root)}:{node.lineno} imports {private}")
    assert not bad, "\n".join(bad)
