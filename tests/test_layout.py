"""The package's layout is its architecture: no import cycles between modules (imports inside functions and under
TYPE_CHECKING included), and the layers point one way (DESIGN.md §3)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "localllm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every localllm module `name` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


@pytest.mark.parametrize("surface", ["localllm.server", "localllm.cli", "localllm.tui"])
def test_surfaces_never_import_a_backend(surface):
    graph = _graph()
    offenders = {
        m: sorted(d for d in deps if d.startswith("localllm.backends"))
        for m, deps in graph.items()
        if m == surface or m.startswith(surface + ".")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_every_module_imports():
    """A broken import (a name moved to another module) fails here, not in the one test that reaches it."""
    import importlib

    broken = {}
    for name in sorted(_modules()):
        if name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported by name
            broken[name] = repr(exc)
    assert broken == {}
