"""The backend seam stays small: LoadedModel's core Protocol has a bounded number of methods, and what only some loads
can do hangs off it as optional parts (backends/base.py), so no backend's model class stubs a capability it lacks.
Each rule is also run on planted source, to show it can fail."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "localllm"
BASE = PACKAGE / "backends" / "base.py"
MODEL_CLASSES = {
    PACKAGE / "backends" / "mlx" / "model.py": "MlxModel",
    PACKAGE / "backends" / "llama_cpp" / "backend.py": "LlamaCppModel",
}
CORE_LIMIT = 12


def _class(source: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def _functions(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    return [n for n in cls.body if isinstance(n, ast.FunctionDef)]


def _core_methods(source: str) -> list[str]:
    """LoadedModel's methods, its optional parts (read-only properties) left out."""
    return [fn.name for fn in _functions(_class(source, "LoadedModel")) if not _is_property(fn)]


def _parts(source: str) -> dict[str, str]:
    """LoadedModel's optional parts: attribute name -> the Protocol it holds (`-> Vision | None`)."""
    parts = {}
    for fn in _functions(_class(source, "LoadedModel")):
        ret = fn.returns
        if _is_property(fn) and isinstance(ret, ast.BinOp) and isinstance(ret.left, ast.Name):
            parts[fn.name] = ret.left.id
    return parts


def _capability_methods(source: str) -> set[str]:
    """The methods of every part's Protocol: what a model class would stub if it had no parts."""
    return {fn.name for protocol in _parts(source).values() for fn in _functions(_class(source, protocol))}


def _stubs(model_source: str, class_name: str, base_source: str) -> list[str]:
    """Capability methods a model class defines itself, and parts it declares on the class as anything but None."""
    cls = _class(model_source, class_name)
    problems = [f"{class_name}.{fn.name}" for fn in _functions(cls) if fn.name in _capability_methods(base_source)]
    parts = _parts(base_source)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in parts:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                problems.append(f"{class_name}.{node.target.id} is set on the class to {ast.unparse(node.value)}")
    return problems


def test_the_core_protocol_has_at_most_twelve_methods():
    methods = _core_methods(BASE.read_text())
    assert "decode" in methods and len(methods) <= CORE_LIMIT, methods


def test_the_core_method_count_can_fail():
    planted = "class LoadedModel:\n" + "".join(f"    def m{i}(self): ...\n" for i in range(CORE_LIMIT + 1))
    planted += "    @property\n    def vision(self) -> Vision | None: ...\n"
    assert len(_core_methods(planted)) == CORE_LIMIT + 1


def test_every_part_is_a_protocol_with_methods():
    source = BASE.read_text()
    parts = _parts(source)
    assert {"vision", "embedder", "reranker", "states", "mtp", "grammars", "threads"} <= set(parts)
    for name, protocol in parts.items():
        assert _functions(_class(source, protocol)), f"{name}: {protocol} has no methods"


def test_no_backend_model_class_stubs_a_capability():
    base = BASE.read_text()
    problems = [p for path, cls in MODEL_CLASSES.items() for p in _stubs(path.read_text(), cls, base)]
    assert not problems


def test_mlx_declares_what_it_cannot_do_as_none():
    cls = _class((PACKAGE / "backends" / "mlx" / "model.py").read_text(), "MlxModel")
    declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"vision", "reranker", "states", "mtp", "grammars", "threads"} <= declared


def test_the_stub_check_can_fail():
    planted = (
        "class MlxModel:\n"
        "    vision: Vision | None = MlxVision()\n"
        "    states: SequenceStates | None = None\n"
        "    def decode(self, batch): ...\n"
        "    def save_seq(self, seq):\n"
        "        return None\n"
    )
    assert _stubs(planted, "MlxModel", BASE.read_text()) == [
        "MlxModel.save_seq",
        "MlxModel.vision is set on the class to MlxVision()",
    ]
