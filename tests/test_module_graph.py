"""The packages' import graph has no loops, counting imports made only for the type checker.

A loop (a module that, through its imports, imports itself) means two modules each know the
other: the layering `docs/architecture.md` draws is gone. Imports under `if TYPE_CHECKING:`
count, because a type-level loop is the same coupling; the fix is a small Protocol of what a
module reads of the other (as `models.decoder.fused_decode.StackSource`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lifecycle", "runtime", "models")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a `from package import name` that names a
    submodule counts as importing it)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif node.module in modules:
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    found.discard(name)
    return found


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return loops


def test_the_finder_sees_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_loops(graph) == [["a", "b", "c"]]
    assert import_loops({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_loops(package: str) -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    loops = [loop for loop in import_loops(graph) if loop[0].split(".")[0] == package]
    assert not loops, f"import loops (break each with a Protocol of what is read): {loops}"
