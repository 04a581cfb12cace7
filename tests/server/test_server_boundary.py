"""The server knows the engine only through EngineClient: it imports nothing from the engine's internals
(the step loop, the in-process core, the runner, scheduler, KV manager or model) and touches none of
their objects (docs/engine_core.md)."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests import REPO_ROOT

SERVER = REPO_ROOT / "kvserve" / "server"
FORBIDDEN_MODULES = (
    "kvserve.engine.request_records",
    "kvserve.engine.info",
    "kvserve.engine.async_engine",
    "kvserve.engine.core",
    "kvserve.engine.core_proc",
    "kvserve.engine.serving_loop",
    "kvserve.engine.detokenizer",
    "kvserve.runner",
    "kvserve.sched",
    "kvserve.kv",
    "kvserve.model",
)
# Attributes of engine internals that a server module must never reach for.
FORBIDDEN_ATTRIBUTES = {
    "kv_manager", "scheduler", "runner", "call_in_engine_thread", "last_scheduler_output",
    "grammar_mask_times_s", "on_grammar_compile", "pool", "num_waiting_samples",
}  # fmt: skip


def _forbidden(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES)


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_server_modules_import_no_engine_internals():
    bad = []
    for path in sorted(SERVER.rglob("*.py")):
        tree = ast.parse(path.read_text())
        bad += [f"{path.name}: {name}" for name in _imports(tree) if _forbidden(name)]
    assert not bad, f"server modules import engine internals: {bad}"


def test_server_modules_touch_no_engine_internals():
    bad = []
    for path in sorted(SERVER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
                bad.append(f"{path.name}:{node.lineno} .{node.attr}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "engine"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "engine"
            ):
                bad.append(f"{path.name}:{node.lineno} .engine.engine")
    assert not bad, f"server code reaches into the engine: {bad}"


def test_importing_the_server_loads_no_engine_internals():
    """Transitively too: importing the app (what `kvserve serve` runs in the API process before it
    starts a core) loads none of the forbidden modules."""
    code = (
        "import sys, kvserve.server.app, kvserve.engine.mp_client\n"
        f"bad = [m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {FORBIDDEN_MODULES!r})]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
