"""The package's import graph: which modules import which (at module level or inside a function;
``if TYPE_CHECKING:`` imports do not run and are left out), and the cycles in it.

The layering goal is no cycle at all. Any cycle still known is pinned in ``KNOWN_CYCLES``, so
that no new one appears and a known one only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "wrapkit"

KNOWN_CYCLES: list[set[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module (relative to the package) -> the package modules it imports."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        type_only = {id(n) for node in ast.walk(tree)
                     if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                     for n in ast.walk(node)}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = [p for p in package if p]
        for node in ast.walk(tree):
            if id(node) in type_only or not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join([*base, *([node.module] if node.module else [])])
            for candidate in (target, *(f"{target}.{a.name}".lstrip(".") for a in node.names)):
                if candidate in graph and candidate != name:
                    graph[name].add(candidate)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_sees_relative_imports() -> None:
    graph = import_graph()
    assert "_registry" in graph[""]  # the package itself and "adapters._base" in graph["adapters.ddp"]
    assert "sync" in graph["view"] and "integrations.trl" in graph["integrations.swift"]


def test_no_cycle_but_the_known_one() -> None:
    found = cycles(import_graph())
    assert sorted(map(sorted, found)) == sorted(map(sorted, KNOWN_CYCLES)), (
        "the import cycles changed; a new cycle must not appear, and a removed one comes off KNOWN_CYCLES: "
        f"{[sorted(c) for c in found]}")
