"""`localllm create` and POST /api/create: a CreateRequest (usually parsed from a Modelfile) becomes a stored model.

The new manifest reuses the parent's weights blob (nothing is copied) and adds layers for what the request sets:
template, system, parameters, messages, license, draft and adapters. Whatever the request leaves out is inherited
from the parent, parameters merged name by name, as Ollama does."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .. import api
from ..errors import InvalidInput, InvalidName
from ..formats.gguf import inspect_gguf
from .names import parse_digest, parse_ref
from .pull import make_source, pull_model
from .store import ResolvedModel, Store
from ..templates import validate_template

Progress = Iterator[api.PullProgress]


def create_model(request: api.CreateRequest, store: Store, *, base_dir: Optional[Path] = None) -> Progress:
    """Store the model `request` describes, yielding progress (the parent is pulled first if it is missing); see
    _create_model. Blobs it adds are safe from `prune` until its manifest names them."""
    with store.writing():
        yield from _create_model(request, store, base_dir=base_dir)


def _create_model(request: api.CreateRequest, store: Store, *, base_dir: Optional[Path] = None) -> Progress:
    """Store the model `request` describes, yielding progress (the parent is pulled first if it is missing).

    Args:
        request: the fields of a Modelfile; `modelfile` text, when given, is parsed and the other fields override it.
        base_dir: where relative paths in FROM and ADAPTER are looked up (the Modelfile's folder); default the cwd.
    Raises:
        InvalidName: the new name or FROM is not a valid name.
        InvalidInput: no FROM, --quantize, unknown parameters or a missing adapter file.
    """
    request = _merge_modelfile(request)
    target = parse_ref(request.model)
    if target.kind == "file":
        raise InvalidName(f"{request.model!r} is a file path; name the new model like me/mymodel:v1")
    if request.quantize and not _wants_mlx(request):
        raise InvalidInput(f"quantize {request.quantize!r} is not supported yet",
                           hint="create from an already quantized GGUF, or pass --format mlx to requantize")
    if not request.from_ and not request.files:
        raise InvalidInput("the model to build on is missing (FROM, or uploaded files)")
    if _wants_mlx(request):
        from ..formats.mlx_convert import check_quantize

        check_quantize(request.quantize)  # before the parent is pulled or copied
    api.split_options(request.parameters)  # an unknown parameter name fails here, before anything is written
    if request.template:
        validate_template(request.template)  # a template that cannot render fails now, not at the first chat
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    yield api.PullProgress(status="parsing modelfile")
    if request.files:
        parent = _parent_from_files(request.files, store)
    else:
        parent = yield from _resolve_parent(request.from_ or "", store, base)
    fmt, weights = parent.format, parent.weights_spec
    details = parent.model.details.model_copy(update={"parent_model": parent.label})
    if _wants_mlx(request) and fmt == "gguf":
        weights = yield from _convert_to_mlx(parent.model.weights, store, request.quantize)
        fmt = "mlx"
        details = details.model_copy(update={"format": "mlx", "quantization_level": (request.quantize or "").upper()
                                             or details.quantization_level})
    yield api.PullProgress(status=f"using existing layer {weights if isinstance(weights, str) else 'mlx files'}")
    adapters = parent.adapters + [_adapter_digest(path, digest, store, base)
                                  for path, digest in request.adapters.items()]
    yield api.PullProgress(status="writing manifest")
    store.write_model(
        target.display, weights=weights, fmt=fmt,
        template=_pick(request.template, parent.model.template),
        system=_pick(request.system, parent.model.system),
        parameters={**parent.model.parameters, **request.parameters},
        messages=request.messages or parent.model.messages,
        license=_pick(request.license, parent.model.license),
        draft=_draft_name(request.draft, base) if request.draft else parent.model.draft,
        adapters=adapters,
        details=details,
    )
    yield api.PullProgress(status="success")


def _wants_mlx(request: api.CreateRequest) -> bool:
    """`--format mlx` or a Modelfile's `PARAMETER backend mlx`: store MLX weights, converted from a GGUF parent."""
    return request.format == "mlx" or request.parameters.get("backend") == "mlx"


def _convert_to_mlx(gguf: Path, store: Store, quantize: Optional[str]) -> Iterator[api.PullProgress]:
    """Convert the parent's GGUF into an MLX folder and add its files as blobs; returns {file name: digest}."""
    import tempfile

    from ..formats.mlx_convert import convert_gguf_to_mlx

    yield api.PullProgress(status="converting to MLX")
    with tempfile.TemporaryDirectory(prefix="localllm-mlx-") as tmp:
        folder = convert_gguf_to_mlx(gguf, Path(tmp) / "mlx", quantize=quantize)
        digests: dict[str, str] = {}
        for file in sorted(folder.iterdir()):
            yield api.PullProgress(status=f"writing {file.name}", total=file.stat().st_size)
            digests[file.name] = store.add_blob_from_file(file)
        return digests


class _Parent:
    """The model a new one builds on: its resolved fields, its weights as write_model takes them, its adapters."""

    def __init__(self, model: ResolvedModel, weights_spec: Union[str, dict[str, str]], adapters: list[str],
                 label: str):
        self.model = model
        self.format = model.format
        self.weights_spec = weights_spec
        self.adapters = adapters
        self.label = label


def _resolve_parent(from_: str, store: Store, base: Path) -> Iterator[api.PullProgress]:
    """FROM is a .gguf path (relative to the Modelfile), a stored model, or a name to pull."""
    ref = parse_ref(from_)
    if ref.kind == "file":
        path = _relative_to(ref.path or Path(from_), base)
        model = store.resolve(str(path))
        yield api.PullProgress(status=f"copying {path}", total=model.size, completed=0)
        digest = store.add_blob_from_file(path)
        return _Parent(model, digest, [], path.name)
    name = ref.display
    if not store.exists(name):
        yield from pull_model(name, store)
        name = make_source(name).stored_name
    _, weights = store.weights_of(name)
    return _Parent(store.resolve(name), weights, store.adapter_digests(name), name)


def _parent_from_files(files: dict[str, str], store: Store) -> _Parent:
    """Ollama's create(files={"model.gguf": "sha256:..."}): the weights are a blob the client uploaded first."""
    ggufs = {name: digest for name, digest in files.items() if name.lower().endswith(".gguf")}
    others = sorted(set(files) - set(ggufs))
    if others:
        raise InvalidInput(f"files {others} are not GGUF: localllm creates models from one .gguf file",
                           hint="convert safetensors weights to GGUF first (llama.cpp's convert_hf_to_gguf.py)")
    if len(ggufs) != 1:
        raise InvalidInput(f"files names {len(ggufs)} .gguf files; localllm creates a model from exactly one")
    name, digest = next(iter(ggufs.items()))
    digest = parse_digest(digest)
    if not store.has_blob(digest):
        raise InvalidInput(f"blob {digest} for {name!r} is not on the server",
                           hint="upload it first: POST /api/blobs/<digest> (what the ollama client's create does)")
    path = store.blob_path(digest)
    info = inspect_gguf(path)  # a file that is no GGUF fails here, before a manifest names it
    model = ResolvedModel(name=name, digest=digest, weights=path, format="gguf", size=path.stat().st_size,
                          details=info.details())
    return _Parent(model, digest, [], name)


def _adapter_digest(path: str, digest: str, store: Store, base: Path) -> str:
    if digest:
        if not store.has_blob(digest):
            raise InvalidInput(f"adapter blob {digest} for {path!r} is not in the store")
        return digest
    file = _relative_to(Path(path).expanduser(), base)
    if not file.is_file():
        raise InvalidInput(f"adapter file {file} does not exist", hint="ADAPTER paths are relative to the Modelfile")
    return store.add_blob_from_file(file)


def _draft_name(draft: str, base: Path) -> str:
    ref = parse_ref(draft)  # an invalid name fails now, not when the model first loads
    if ref.kind == "file":
        return str(_relative_to(ref.path or Path(draft), base))
    return ref.display


def _merge_modelfile(request: api.CreateRequest) -> api.CreateRequest:
    if not request.modelfile:
        return request
    from .modelfile import parse_modelfile

    parsed = parse_modelfile(request.modelfile)
    explicit = {name: getattr(request, name) for name in request.model_fields_set if name != "modelfile"}
    return parsed.model_copy(update={**explicit, "model": request.model})


def _relative_to(path: Path, base: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def _pick(value: Any, inherited: Any) -> Any:
    return inherited if value is None else value
