"""`localllm create` and POST /api/create: a CreateRequest (usually parsed from a Modelfile) becomes a stored model.

The new manifest reuses the parent's weights blob (nothing is copied) and adds layers for what the request sets:
template, system, parameters, messages, license, draft and adapters. Whatever the request leaves out is inherited
from the parent, parameters merged name by name, as Ollama does. With `quantize` the weights are new: the parent's
GGUF quantized by llama.cpp in a worker process (quant/quantize.py), stored with its quality report."""

from __future__ import annotations

import shutil
from collections.abc import Generator, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

from .. import api, config
from ..chat.templates import validate_template
from ..errors import InvalidInput, InvalidName, ModelFormatError
from ..machine import physical_cores
from ..quant.gguf import inspect_gguf
from .adapters import check_adapter_fits
from .names import parse_digest, parse_ref
from .pull import make_source, pull_model
from .store import ResolvedModel, Store, Weights

Progress = Iterator[api.PullProgress]


def create_model(request: api.CreateRequest, store: Store, *, base_dir: Path | None = None) -> Progress:
    """Store the model `request` describes, yielding progress (the parent is pulled first if it is missing); see
    _create_model. Blobs it adds are safe from `prune` until its manifest names them."""
    with store.blobs.writing():
        yield from _create_model(request, store, base_dir=base_dir)


def _create_model(request: api.CreateRequest, store: Store, *, base_dir: Path | None = None) -> Progress:
    """Store the model `request` describes, yielding progress (the parent is pulled first if it is missing).

    Args:
        request: the fields of a Modelfile; `modelfile` text, when given, is parsed and the other fields override it.
        base_dir: where relative paths in FROM and ADAPTER are looked up (the Modelfile's folder); default the cwd.
    Raises:
        InvalidName: the new name or FROM is not a valid name.
        InvalidInput: no FROM, a bad quantize type, a quantized parent without allow_requantize, unknown parameters,
            a missing adapter file or one that is not a GGUF LoRA (ModelFormatError, also HTTP 400).
    """
    request = _projector_second(_merge_modelfile(request), base_dir)
    target = parse_ref(request.model)
    _check_request(request)
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    # Refusals come before the first progress line, so that /api/create answers them with a status code.
    adapters_files = {path: _adapter_file(path, digest, store, base) for path, digest in request.adapters.items()}
    projector = _projector_file(request.projector, base) if request.projector else None
    if request.quantize and not _wants_mlx(request):
        _check_quantize_early(request, store, base)
    yield api.PullProgress(status="parsing modelfile")
    if request.files:
        parent = _parent_from_files(request.files, store)
    else:
        parent = yield from _resolve_parent(request.from_ or "", store, base)  # FROM checked in _check_request
    if (parent.format == "mlx" or _wants_mlx(request)) and (parent.adapters or adapters_files):
        raise InvalidInput(
            "LoRA adapters are not supported on the MLX backend yet",
            hint="keep the model and its adapters in GGUF (without --format mlx)",
        )
    fmt, weights = parent.format, parent.weights_spec
    details = parent.model.details.model_copy(update={"parent_model": parent.label})
    quality = None
    if _wants_mlx(request) and fmt == "gguf":
        weights = yield from _convert_to_mlx(parent.model.weights, store, request.quantize)
        fmt = "mlx"
        details = details.model_copy(
            update={
                "format": "mlx",
                "quantization_level": (request.quantize or "").upper() or details.quantization_level,
            }
        )
    elif request.quantize:
        weights, quality = yield from _quantize(parent, request, store, base)
        details = _gguf_details(store, weights).model_copy(update={"parent_model": parent.label})
    else:
        yield api.PullProgress(status=f"using existing layer {_describe_weights(weights)}")
    adapters = parent.adapters + [
        _store_adapter(path, file, request.adapter_scales.get(path, 1.0), store, parent)
        for path, file in adapters_files.items()
    ]
    projectors = [_store_projector(projector, store, parent, fmt)] if projector else parent.projectors
    yield api.PullProgress(status="writing manifest")
    store.write_model(
        target.display,
        weights=weights,
        fmt=fmt,
        template=_pick(request.template, parent.model.template),
        system=_pick(request.system, parent.model.system),
        parameters={**parent.model.parameters, **request.parameters},
        messages=request.messages or parent.model.messages,
        license=_pick(request.license, parent.model.license),
        draft=_draft_name(request.draft, base) if request.draft else parent.model.draft,
        adapters=adapters,
        projectors=projectors,
        details=details,
        quality=quality,
    )
    yield api.PullProgress(status="success")


def _check_request(request: api.CreateRequest) -> None:
    """What can be refused from the request alone, before anything is pulled, copied or written."""
    if parse_ref(request.model).kind == "file":
        raise InvalidName(f"{request.model!r} is a file path; name the new model like me/mymodel:v1")
    if not request.from_ and not request.files:
        raise InvalidInput("the model to build on is missing (FROM, or uploaded files)")
    if request.imatrix and not request.quantize:
        raise InvalidInput("an imatrix is only used when quantizing", hint="add --quantize TYPE")
    if _wants_mlx(request):
        from ..quant.mlx_convert import check_quantize

        check_quantize(request.quantize)
        if request.adapters:
            raise InvalidInput(
                "LoRA adapters are not supported on the MLX backend yet",
                hint="keep the model and its adapters in GGUF (without --format mlx)",
            )
    elif request.quantize:
        from ..quant.quantize import quant_type

        quant_type(request.quantize)  # a type llama.cpp's quantizer offers
    api.split_options(request.parameters)  # an unknown parameter name fails here
    if request.template:
        validate_template(request.template)  # a template that cannot render fails now, not at the first chat


def _describe_weights(weights: Weights) -> str:
    if isinstance(weights, str):
        return weights
    return f"{len(weights)} GGUF parts" if isinstance(weights, list) else "mlx files"


def _quantize(
    parent: _Parent, request: api.CreateRequest, store: Store, base: Path
) -> Generator[api.PullProgress, None, tuple[str, api.QuantizationReport | None]]:
    """Quantize the parent's GGUF into a new blob; return (digest, quality report)."""
    from ..quant.quality import describe_report
    from ..quant.quantize import run_quantize

    if parent.format != "gguf":
        raise InvalidInput(
            f"{parent.label} is an {parent.format} model; --quantize works on GGUF weights",
            hint="MLX models are quantized when converted: --format mlx --quantize q4",
        )
    imatrix = _relative_to(Path(request.imatrix), base) if request.imatrix else None
    scratch = store.blobs.scratch_dir()  # inside the store, so the result moves into the blobs without a copy
    try:
        out = scratch / "model.gguf"
        report = yield from run_quantize(
            parent.model.weights,
            out,
            request.quantize or "",
            label=parent.label,
            allow_requantize=request.allow_requantize,
            imatrix=imatrix,
            threads=config.NUM_THREAD.get() or physical_cores(),
            report_tokens=config.QUALITY_TOKENS.get(),
        )
        for line in describe_report(report) if report else []:
            yield api.PullProgress(status=line)
        yield api.PullProgress(status="writing quantized weights")
        return store.blobs.adopt(out), report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        with suppress(OSError):
            scratch.parent.rmdir()  # the store's tmp/ folder, unless another create is using it


def _check_quantize_early(request: api.CreateRequest, store: Store, base: Path) -> None:
    """The quantizer's refusals (a quantized parent, a missing imatrix) for a parent already at hand; a parent that
    must be pulled first is checked once it is (in run_quantize)."""
    from ..quant.quantize import check_quantize, quant_type

    ref = parse_ref(request.from_ or "")
    name = str(_relative_to(ref.path or Path(request.from_ or ""), base)) if ref.kind == "file" else ref.display
    if not store.exists(name):
        return
    parent = store.resolve(name)
    if parent.format == "gguf":
        imatrix = _relative_to(Path(request.imatrix), base) if request.imatrix else None
        check_quantize(
            parent.weights,
            quant_type(request.quantize or ""),
            allow_requantize=request.allow_requantize,
            imatrix=imatrix,
            label=parent.name,
        )


def _gguf_details(store: Store, digest: Weights) -> api.ModelDetails:
    from ..quant.gguf import inspect_gguf

    assert isinstance(digest, str)
    return inspect_gguf(store.blobs.path(digest)).details()


def _wants_mlx(request: api.CreateRequest) -> bool:
    """`--format mlx` or a Modelfile's `PARAMETER backend mlx`: store MLX weights, converted from a GGUF parent."""
    return request.format == "mlx" or request.parameters.get("backend") == "mlx"


def _convert_to_mlx(
    gguf: Path, store: Store, quantize: str | None
) -> Generator[api.PullProgress, None, dict[str, str]]:
    """Convert the parent's GGUF into an MLX folder and add its files as blobs; returns {file name: digest}."""
    import tempfile

    from ..quant.mlx_convert import convert_gguf_to_mlx

    yield api.PullProgress(status="converting to MLX")
    with tempfile.TemporaryDirectory(prefix="localllm-mlx-") as tmp:
        folder = convert_gguf_to_mlx(gguf, Path(tmp) / "mlx", quantize=quantize)
        digests: dict[str, str] = {}
        for file in sorted(folder.iterdir()):
            yield api.PullProgress(status=f"writing {file.name}", total=file.stat().st_size)
            digests[file.name] = store.blobs.add_file(file)
        return digests


class _Parent:
    """The model a new one builds on: its resolved fields, its weights as write_model takes them, its adapters."""

    def __init__(
        self,
        model: ResolvedModel,
        weights_spec: Weights,
        adapters: list[tuple[str, float]],
        label: str,
        projectors: list[str] | None = None,
    ):
        self.model = model
        self.format = model.format
        self.weights_spec = weights_spec
        self.adapters = adapters
        self.label = label
        self.projectors = projectors or []  # the vision projector's digest, which a new model inherits


def _resolve_parent(from_: str, store: Store, base: Path) -> Generator[api.PullProgress, None, _Parent]:
    """FROM is a .gguf path (relative to the Modelfile), a stored model, or a name to pull."""
    ref = parse_ref(from_)
    if ref.kind == "file":
        path = _relative_to(ref.path or Path(from_), base)
        model = store.resolve(str(path))
        if model.details.family == "clip":
            raise InvalidInput(
                f"{path} is a vision projector, not a model",
                hint="FROM the model's weights first, then the projector on a second FROM line",
            )
        yield api.PullProgress(status=f"copying {path}", total=model.size, completed=0)
        digests = [store.blobs.add_file(part) for part in model.parts]  # every part of a split GGUF
        return _Parent(model, digests[0] if len(digests) == 1 else digests, [], path.name)
    name = ref.display
    if not store.exists(name):
        yield from pull_model(name, store)
        name = make_source(name).stored_name
    _, weights = store.weights_of(name)
    return _Parent(store.resolve(name), weights, store.adapter_layers(name), name, store.projector_layers(name))


def _parent_from_files(files: dict[str, str], store: Store) -> _Parent:
    """Ollama's create(files={"model.gguf": "sha256:..."}): the weights are a blob the client uploaded first, and a
    second GGUF whose architecture is `clip` is the model's vision projector (as Ollama tells them apart)."""
    ggufs = {name: digest for name, digest in files.items() if name.lower().endswith(".gguf")}
    others = sorted(set(files) - set(ggufs))
    if others:
        raise InvalidInput(
            f"files {others} are not GGUF: localllm creates models from one .gguf file",
            hint="convert safetensors weights to GGUF first (llama.cpp's convert_hf_to_gguf.py)",
        )
    infos = {name: inspect_gguf(_uploaded_blob(name, digest, store)) for name, digest in ggufs.items()}
    models = [name for name, info in infos.items() if info.architecture != "clip"]
    projectors = [name for name, info in infos.items() if info.architecture == "clip"]
    if len(models) != 1 or len(projectors) > 1:
        raise InvalidInput(
            f"files names {len(models)} model .gguf files and {len(projectors)} vision projectors; localllm creates "
            "a model from exactly one, with at most one projector"
        )
    name = models[0]
    info = infos[name]
    path = info.path
    model = ResolvedModel(
        name=name,
        digest=parse_digest(ggufs[name]),
        weights=path,
        format="gguf",
        size=path.stat().st_size,
        details=info.details(),
    )
    if projectors:
        from ..quant.gguf import inspect_projector

        inspect_projector(infos[projectors[0]].path)  # a clip GGUF without a vision encoder fails here
    return _Parent(model, model.digest, [], name, [parse_digest(ggufs[p]) for p in projectors])


def _uploaded_blob(name: str, digest: str, store: Store) -> Path:
    """The blob a client uploaded for `name`, checked to be a GGUF file before a manifest names it."""
    digest = parse_digest(digest)
    if not store.blobs.has(digest):
        raise InvalidInput(
            f"blob {digest} for {name!r} is not on the server",
            hint="upload it first: POST /api/blobs/<digest> (what the ollama client's create does)",
        )
    return store.blobs.path(digest)


def _projector_second(request: api.CreateRequest, base_dir: Path | None) -> api.CreateRequest:
    """Two FROMs in either order, as Ollama takes them: the one that is a `clip` GGUF file is the projector."""
    if not request.projector or not request.from_ or parse_ref(request.from_).kind != "file":
        return request
    first = _relative_to(Path(request.from_), Path(base_dir) if base_dir is not None else Path.cwd())
    try:
        swapped = first.is_file() and inspect_gguf(first).architecture == "clip"
    except ModelFormatError:
        return request  # not a GGUF: resolving the FROM says so
    if not swapped:
        return request
    return request.model_copy(update={"from_": request.projector, "projector": request.from_})


def _projector_file(path: str, base: Path) -> Path:
    """The second FROM's file, checked to be a vision projector before anything is copied."""
    from ..quant.gguf import PROJECTOR_HINT, inspect_projector

    file = _relative_to(Path(path), base)
    if not file.is_file():
        raise InvalidInput(f"vision projector file {file} does not exist", hint=PROJECTOR_HINT)
    inspect_projector(file)
    return file


def _store_projector(file: Path, store: Store, parent: _Parent, fmt: str) -> str:
    """Check the projector feeds embeddings as wide as the model's, then store it; its digest for the manifest."""
    from ..quant.gguf import inspect_projector

    if fmt != "gguf":
        raise InvalidInput("a vision projector needs GGUF weights", hint="create the model without --format mlx")
    width = inspect_projector(file).output_width
    text_width = inspect_gguf(parent.model.weights).embedding_length
    if width is not None and text_width is not None and width != text_width:
        raise InvalidInput(
            f"vision projector {file.name} makes {width}-wide embeddings, but {parent.label} reads {text_width}",
            hint="use the projector made for this model (the mmproj file published beside its weights)",
        )
    return store.blobs.add_file(file)


def _adapter_file(path: str, digest: str, store: Store, base: Path) -> Path:
    """The adapter's file (a path, or a blob already in the store), checked to be a GGUF LoRA before anything is
    copied: a wrong file is refused here, never stored."""
    from ..quant.gguf import inspect_lora

    if digest:
        if not store.blobs.has(digest):
            raise InvalidInput(f"adapter blob {digest} for {path!r} is not in the store")
        file = store.blobs.path(digest)
    else:
        file = _relative_to(Path(path).expanduser(), base)
        if not file.is_file():
            raise InvalidInput(
                f"adapter file {file} does not exist", hint="ADAPTER paths are relative to the Modelfile"
            )
    inspect_lora(file)
    return file


def _store_adapter(path: str, file: Path, scale: float, store: Store, parent: _Parent) -> tuple[str, float]:
    """Check the adapter fits the parent's architecture and every tensor shape, then store it; (digest, scale) for
    the manifest."""
    check_adapter_fits(file, parent.model.weights, parent.label, path)
    return store.blobs.add_file(file), scale


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
