"""No import cycles in `kvserve`, function-level imports included (docs/design.md, "Layers").

The graph and its rules are in tests/import_graph.py: every import statement counts wherever it
stands (module level, inside a function, under `if TYPE_CHECKING:`), relative imports are resolved,
and `from kvserve.a import b` is an edge to the submodule `kvserve.a.b` when there is one, else to
the package `kvserve.a`. A cycle is a strongly connected component of more than one module; the
failure lists each with the import lines that close it.
"""

from __future__ import annotations

from tests import import_graph
from tests.import_graph import cycles, graph, imports, modules


def _explain(component: list[str]) -> str:
    members = set(component)
    lines = [" <-> ".join(component)]
    for imp in sorted(set(imports()), key=lambda i: (i.module, i.line, i.target)):
        if imp.module in members and imp.target in members:
            where = "in a function" if imp.in_function else "at module level"
            path = modules()[imp.module].relative_to(import_graph.ROOT)
            lines.append(f"    {path}:{imp.line} imports {imp.target} ({where})")
    return "\n".join(lines)


def test_the_package_has_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(_explain(c) for c in found)


def test_package_inits_close_no_cycle():
    """Python runs `kvserve/a/__init__.py` before `kvserve.a.b`: with an edge from every importer
    outside `kvserve.a` to the package itself, the graph is still acyclic."""
    edges = graph()
    for module, targets in list(edges.items()):
        for target in list(targets):
            parts = target.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in edges and not module.startswith(package + "."):
                    edges[module].add(package)
    found = cycles(edges)
    assert not found, "import cycles through a package __init__:\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_graph_sees_function_level_and_relative_imports():
    """The reader itself: a cycle closed inside a function is found, and so is one spelled with
    relative imports (a test that cannot fail is a defect)."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    seen = {(i.module, i.target) for i in imports() if i.in_function}
    assert seen, "no function-level import found: the reader misses them"
    resolved = import_graph._resolve(
        "kvserve.lab.plan.model", False, __import__("ast").parse("from .arith import x").body[0]
    )
    assert resolved == ["kvserve.lab.plan.arith"]
