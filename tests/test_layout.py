"""The package's layout is its architecture: no import cycles between modules (imports inside functions and under
TYPE_CHECKING included), the layers point one way (DESIGN.md §3) and private names stay in their modules. Each rule
is also run on a planted violation, to show it can fail."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
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


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _crossings(
    graph: dict[str, set[str]], layer: tuple[str, ...], banned: tuple[str, ...], allowed: frozenset[str] = frozenset()
) -> dict[str, list[str]]:
    """The modules of `layer` that import a module of `banned` (other than those `allowed`), and what they import."""
    found = {
        module: sorted(d for d in deps if _under(d, banned) and d not in allowed)
        for module, deps in graph.items()
        if _under(module, layer)
    }
    return {module: deps for module, deps in found.items() if deps}


SURFACES = ("localllm.server", "localllm.cli", "localllm.tui")
# The model manager, GGUF/MLX formats and chat templates sit below the engine: they serve every layer above.
LOWER = ("localllm.models", "localllm.quant", "localllm.chat")
ABOVE_LOWER = ("localllm.engine", "localllm.client", *SURFACES)
# The engine reaches backends through the registry and the Protocol alone: it runs whichever backend it is given.
ENGINE_MAY_IMPORT = frozenset({"localllm.backends", "localllm.backends.base"})
# The client and the surfaces name no backend. Two commands reach the registry (never a backend module): `worker`
# serves llama.cpp's RPC devices, and `plan` asks the chosen backend where a load's layers would go, before any load.
NO_BACKEND = ("localllm.client", *SURFACES)
SURFACE_MAY_IMPORT = {
    "localllm.cli.worker": frozenset({"localllm.backends"}),
}


def _backend_crossings(graph: dict[str, set[str]], layer: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of `layer` that import a backend module, less what SURFACE_MAY_IMPORT allows each."""
    found = {
        module: [d for d in deps if d not in SURFACE_MAY_IMPORT.get(module, frozenset())]
        for module, deps in _crossings(graph, layer, ("localllm.backends",)).items()
    }
    return {module: deps for module, deps in found.items() if deps}


@pytest.mark.parametrize("layer", NO_BACKEND)
def test_the_client_and_surfaces_never_import_a_backend(layer):
    assert _backend_crossings(_graph(), (layer,)) == {}


def test_the_backend_allow_list_can_fail():
    planted = {
        "localllm.cli.plan": {"localllm.backends", "localllm.backends.llama_cpp.backend"},
        "localllm.cli.worker": {"localllm.backends", "localllm.backends.llama_cpp.rpc"},
        "localllm.cli.models": {"localllm.backends"},
        "localllm.tui.app": {"localllm.backends.mlx"},
        "localllm.client.local": {"localllm.backends.base", "localllm.engine.pool"},
    }
    assert _backend_crossings(planted, NO_BACKEND) == {
        "localllm.cli.plan": ["localllm.backends", "localllm.backends.llama_cpp.backend"],
        "localllm.cli.worker": ["localllm.backends.llama_cpp.rpc"],
        "localllm.cli.models": ["localllm.backends"],
        "localllm.tui.app": ["localllm.backends.mlx"],
        "localllm.client.local": ["localllm.backends.base"],
    }


def test_the_engine_imports_no_concrete_backend():
    assert _crossings(_graph(), ("localllm.engine",), ("localllm.backends",), ENGINE_MAY_IMPORT) == {}


def test_models_quant_and_chat_import_nothing_above_them():
    assert _crossings(_graph(), LOWER, ABOVE_LOWER) == {}


# The browser page's static files, served by server/web_routes.py: no Python lives there, so nothing imports from it
# and the page reaches the product through the public API alone.
WEB = PACKAGE / "web"


def _python_under(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*.py"))


def test_web_holds_no_python():
    assert _python_under(WEB) == []


def test_the_web_check_can_fail(tmp_path):
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "helper.py").write_text("")
    assert _python_under(tmp_path) == ["vendor/helper.py"]


def test_each_layer_rule_can_fail():
    planted = {
        "localllm.server.app": {"localllm.backends.mlx"},
        "localllm.engine.pool": {"localllm.backends", "localllm.backends.base", "localllm.backends.llama_cpp.probe"},
        "localllm.engine.runner": {"localllm.backends.base"},
        "localllm.models.info": {"localllm.engine.text"},
        "localllm.quant.quantize": {"localllm.client.local"},
        "localllm.chat.templates": {"localllm.cli.render", "localllm.models.store"},
        "localllm.models.store": {"localllm.quant.gguf"},
    }
    assert _crossings(planted, SURFACES, ("localllm.backends",)) == {"localllm.server.app": ["localllm.backends.mlx"]}
    assert _crossings(planted, ("localllm.engine",), ("localllm.backends",), ENGINE_MAY_IMPORT) == {
        "localllm.engine.pool": ["localllm.backends.llama_cpp.probe"]
    }
    assert _crossings(planted, LOWER, ABOVE_LOWER) == {
        "localllm.models.info": ["localllm.engine.text"],
        "localllm.quant.quantize": ["localllm.client.local"],
        "localllm.chat.templates": ["localllm.cli.render"],
    }


def _private_imports(sources: dict[str, str]) -> list[str]:
    """`from localllm.x import _name` in another module of the package: a private name crossing modules."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("localllm")):
                found += [
                    f"{name}: {a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return sorted(found)


def test_no_private_name_crosses_modules():
    assert _private_imports({name: path.read_text() for name, path in _modules().items()}) == []


def test_the_private_name_check_can_fail():
    planted = {
        "localllm.bench.raw": "from ..backends.llama_cpp.backend import _init_backend, LlamaCppBackend",
        "localllm.quant.quantize": "def f():\n    from .gguf import _read_header\n",
        "localllm.backends.llama_cpp.backend": "from llama_cpp import _logger\nfrom .. import __version__",
    }
    assert _private_imports(planted) == ["localllm.bench.raw: _init_backend", "localllm.quant.quantize: _read_header"]


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


# ---------------------------------------------------------------------------------------------------------- README

ROOT = PACKAGE.parent


def _layout_block(readme: str) -> list[str]:
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].strip("\n").splitlines()


def _named_paths(lines: list[str]) -> list[Path]:
    """The paths in the block's first column: `localllm/server/ cli/ tui/` names localllm/server, localllm/cli and
    localllm/tui (a bare name sits beside the row's first path; one with a folder in it starts at the root)."""
    paths = []
    for line in lines:
        column = line.split("  ", 1)[0].split()
        if not column:
            continue
        first = ROOT / column[0]
        paths.append(first)
        for token in column[1:]:
            paths.append(ROOT / token if "/" in token.rstrip("/") else first.parent / token)
    return paths


def _layout_problems(lines: list[str]) -> list[str]:
    problems = [f"{p.relative_to(ROOT)} is named but does not exist" for p in _named_paths(lines) if not p.exists()]
    text = "\n".join(lines)
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        if folder != PACKAGE and f"{folder.name}/" not in text:
            problems.append(f"{folder.relative_to(ROOT)}/ is a package the Layout section does not name")
    return problems


def test_the_readme_layout_matches_the_tree():
    assert _layout_problems(_layout_block((ROOT / "README.md").read_text())) == []


def test_the_readme_layout_check_can_fail():
    lines = _layout_block((ROOT / "README.md").read_text())
    renamed = [line.replace("localllm/quant/", "localllm/formats/") for line in lines]
    assert "localllm/formats is named but does not exist" in _layout_problems(renamed)
    dropped = [line for line in lines if not line.startswith("localllm/chat/")]
    assert "localllm/chat/ is a package the Layout section does not name" in _layout_problems(dropped)


# ---------------------------------------------------------------------------------------------------------- seams

SURFACE_PACKAGES = ("client", "server", "cli", "tui")


def _reaches_into_the_engine(source: str) -> bool:
    """`x.engine.model`: a surface reaching past the engine to the backend's loaded model."""
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "model"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "engine"
        for node in ast.walk(ast.parse(source))
    )


def test_the_surfaces_ask_the_engine_not_its_model():
    reaching = [
        str(path.relative_to(ROOT))
        for package in SURFACE_PACKAGES
        for path in (PACKAGE / package).rglob("*.py")
        if _reaches_into_the_engine(path.read_text())
    ]
    assert reaching == []


def test_the_engine_reach_check_can_fail():
    assert _reaches_into_the_engine("meta = loaded.engine.model.meta\n")
    assert not _reaches_into_the_engine("meta = loaded.engine.meta\n")


# ---------------------------------------------------------------------------------------------------------- figures

# A measurement in a docstring or comment: milliseconds, ratios, decimal seconds, rates, a slowdown in percent, a
# date, a CPU's name. Quoted text is left out: "500ms" there is the syntax a function reads, not a figure.
FIGURE = re.compile(
    r"\d+(\.\d+)?\s?(ms|µs|us)\b|\d+(\.\d+)?x\b|×|\d+\.\d+\s?s\b|\d+\s?(tok|tokens)/s\b|\d+%\s(slower|faster)\b"
    r"|\b20\d\d-\d\d-\d\d\b|\b(EPYC|Xeon|Ryzen|Threadripper|Graviton|Neoverse)\b"
)
QUOTED = re.compile(r"\"[^\"\n]*\"|`[^`\n]*`")


def _prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def _figures(sources: dict[str, str]) -> list[str]:
    """`module:line: figure` for each measurement in a docstring or comment (the story is docs/benchmark-notes.md's)."""
    return [
        f"{name}:{line}: {match.group(0)}"
        for name, source in sources.items()
        for line, text in _prose(source)
        for match in FIGURE.finditer(QUOTED.sub("", text))
    ]


def test_no_figures_in_docstrings_or_comments():
    assert _figures({name: path.read_text() for name, path in _modules().items()}) == []


def test_the_figure_check_can_fail():
    planted = '''"""Steps took 11 ms (2026-12-04)."""

def f():
    """1.20x as long as alone, on the EPYC; a decode step 0.05 s."""
    return "500ms"  # 30 ms beside 10 ms ones, 19% slower, 40 tok/s


def g(keep_alive="5m"):
    """A Go duration such as "300ms"; `1.5x` is quoted, as is "300 ms"; 4 x n_embd flops; 5% of the memory."""
'''
    assert _figures({"localllm.planted": planted}) == [
        "localllm.planted:1: 11 ms",
        "localllm.planted:1: 2026-12-04",
        "localllm.planted:4: 1.20x",
        "localllm.planted:4: EPYC",
        "localllm.planted:4: 0.05 s",
        "localllm.planted:5: 30 ms",
        "localllm.planted:5: 10 ms",
        "localllm.planted:5: 19% slower",
        "localllm.planted:5: 40 tok/s",
    ]


# ---------------------------------------------------------------------------------------------------------- streams


def _close_probes(source: str) -> list[int]:
    """Lines that ask an object whether it can be closed (`getattr(x, "close", ...)`, `hasattr(x, "close")`): the
    Client's streams and the Client itself are typed (client/protocol.py), so nothing needs to ask."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "close"
    )


def test_nothing_probes_for_close():
    probing = [f"{name}:{line}" for name, path in _modules().items() for line in _close_probes(path.read_text())]
    assert probing == []


def test_the_close_probe_check_can_fail():
    planted = (
        'close = getattr(stream, "close", None)\n'
        'getattr(chunks, "close", lambda: None)()\n'
        'if hasattr(served, "close"):\n'
        "    served.close()\n"
        'name = getattr(tool, "name")\n'
    )
    assert _close_probes(planted) == [1, 2, 3]
