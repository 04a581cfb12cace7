"""The import graph of the `kvserve` package, read from the source (no module is imported).

The rules, used by tests/project/test_import_cycles.py and tests/project/test_layers.py (docs/design.md):

- A node is a module of the package; a package is its `__init__.py` (`kvserve.lab.plan`).
- Every import statement counts wherever it stands: at module level, inside a function or method,
  under `if TYPE_CHECKING:`, in a `try:`. An import moved into a function still runs, and a cycle
  that only a function-level import closes is still a cycle.
- `import kvserve.a.b` is an edge to `kvserve.a.b`. `from kvserve.a import b` is an edge to
  `kvserve.a.b` when `b` is a submodule, else to `kvserve.a` (the package's `__init__` is what
  provides the name). Relative imports are resolved against the importing module's package.
- The parent packages that Python initialises on the way to `kvserve.a.b` are not edges: a package
  `__init__` that re-exports its submodules (`kvserve.lab.plan`) would otherwise make each of them a
  cycle with their own package. Only `kvserve.lab.plan`, `kvserve.cli` and `kvserve` import anything in
  their `__init__`, and tests/project/test_import_cycles.py checks that those imports stay acyclic too.
- Dynamic imports (`importlib.import_module`) are not seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvserve"


@dataclass(frozen=True)
class Import:
    """One import statement's target: `module` imports `target` at `line`."""

    module: str
    target: str  # a module of kvserve, or a third-party top-level name such as "torch"
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = ("kvserve", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    known = modules()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            package = ".".join(base + ([node.module] if node.module else []))
        else:
            package = node.module or ""
        names = [
            f"{package}.{a.name}" if f"{package}.{a.name}" in known else package for a in node.names
        ]
    out = []
    for name in names:
        if name.split(".")[0] != "kvserve":
            out.append(name.split(".")[0])  # a third-party or standard-library top-level name
            continue
        while name not in known:  # `import kvserve.a.b.Name` cannot happen; be safe anyway
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


@cache
def imports() -> tuple[Import, ...]:
    """Every import statement of the package, resolved."""
    found = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        functions = [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _resolve(module, path.name == "__init__.py", node):
                    if target != module:
                        found.append(Import(module, target, node.lineno, id(node) in nested))
    return tuple(found)


def graph() -> dict[str, set[str]]:
    """module -> the kvserve modules it imports."""
    edges: dict[str, set[str]] = {m: set() for m in modules()}
    for imp in imports():
        if imp.target in edges:
            edges[imp.module].add(imp.target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
