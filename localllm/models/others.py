"""Models that other tools already keep on disk, found and made localllm models without copying their weights.

    ollama     $OLLAMA_MODELS, else ~/.ollama/models and /usr/share/ollama/.ollama/models (Linux's service):
               manifests/<host>/<namespace>/<name>/<tag> naming blobs/sha256-<hex>
    lmstudio   ~/.lmstudio/models/<publisher>/<repo>/*.gguf (and the older ~/.cache/lm-studio/models)
    hf         the Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub):
               models--<org>--<repo>/snapshots/<revision>/*.gguf

An import references the other tool's file (Blobs.add_reference: a hard link on the same file system, else a checked
symlink), so no weights are copied. An Ollama model keeps its name, template, system prompt, parameters, messages,
license and adapters; a GGUF of LM Studio or the Hugging Face cache is named `<publisher>/<repo>:<file stem>` or
`hf.co/<org>/<repo>:<file stem>`. A vision projector file (architecture `clip`) is no model and is not listed. Nothing
under those folders is ever written, moved or removed: `rm` and `prune` remove only our names for the files.

Every file is read through its resolved path, which must be a regular file inside the tool's own folder (Ollama's
blobs folder, the LM Studio models folder, the cached repo): a link there that leads elsewhere is refused, never read,
linked or served. An adapter must fit the model, as `create` checks it. A failed import leaves nothing behind."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
from collections.abc import Generator, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .. import api
from ..errors import InvalidInput, InvalidName, LocalLLMError, ModelFormatError, ModelNotFound
from .adapters import check_adapter_fits
from .files import confined_file
from .names import parse_ref
from .registry import MAX_MANIFEST_BYTES, Layer, model_fields, parse_manifest
from .store import Store

log = logging.getLogger(__name__)

Tool = Literal["ollama", "lmstudio", "hf"]
TOOLS: tuple[Tool, ...] = ("ollama", "lmstudio", "hf")
TOOL_NAMES = {"ollama": "Ollama", "lmstudio": "LM Studio", "hf": "the Hugging Face cache"}
OLLAMA_HOST = "registry.ollama.ai"  # the host Ollama files its library's manifests under
_NO_FOLLOW = 0 if sys.platform == "win32" else os.O_NOFOLLOW

Progress = Iterator[api.PullProgress]


@dataclass(frozen=True)
class OtherModel:
    """One model another tool keeps: the name it gets here, and the files it is made of."""

    tool: Tool
    name: str
    origin: str  # the other tool's own record of it: Ollama's manifest file, else the (first) GGUF file
    weights: tuple[Path, ...]  # the GGUF file, or a split GGUF's parts in order
    size: int
    layers: tuple[Layer, ...] = field(default=(), repr=False)  # an Ollama model's layers
    blobs: Path | None = None  # Ollama's blobs folder
    within: Path | None = None  # the tool's folder that every file of the model must resolve inside


# ------------------------------------------------------------------------------------------------------- where


def ollama_dirs() -> list[Path]:
    """OLLAMA_MODELS when set, else the user's folder and the one of Linux's system service (user `ollama`)."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def lmstudio_dirs() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def hf_cache_dir() -> Path:
    # Read at call time (huggingface_hub reads these once, at import).
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = (
        os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    )
    return Path(hf_home).expanduser() / "hub"


def searched(tools: Iterable[Tool] = TOOLS) -> str:
    """Where `find_others` looks, as a user reads it."""
    places = {"ollama": ollama_dirs(), "lmstudio": lmstudio_dirs(), "hf": [hf_cache_dir()]}
    return "; ".join(f"{TOOL_NAMES[tool]}: {', '.join(map(str, places[tool]))}" for tool in tools)


# ------------------------------------------------------------------------------------------------------- finding


def find_others(tools: Iterable[Tool] = TOOLS) -> list[OtherModel]:
    """Every model the given tools keep, sorted by tool then name. What cannot be read is skipped with a warning."""
    finders = {"ollama": _ollama_models, "lmstudio": _lmstudio_models, "hf": _hf_models}
    return [model for tool in tools for model in sorted(finders[tool](), key=lambda m: m.name)]


def find_other(name: str, tools: Iterable[Tool] = TOOLS) -> OtherModel:
    """The model called `name` here (or whose other tool calls it so: `llama3.2`, a GGUF's path).

    Raises:
        ModelNotFound: no tool keeps it; the message says where we looked.
    """
    tools = tuple(tools)
    try:
        wanted = parse_ref(name).display
    except InvalidName:
        wanted = name
    for model in find_others(tools):
        if wanted in (model.name, model.origin) or any(name == str(path) for path in model.weights):
            return model
    raise ModelNotFound(f"no model {name!r} found in {searched(tools)}", hint="`localllm ls --others` lists them")


def _ollama_models() -> Iterator[OtherModel]:
    for root in ollama_dirs():
        manifests = root / "manifests"
        for path in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
            host, namespace, model, tag = path.relative_to(manifests).parts
            try:
                yield _ollama_model(root, path, _ollama_name(host, namespace, model, tag))
            except (LocalLLMError, OSError) as exc:
                log.warning("skipping Ollama's %s: %s", path, exc)


def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host == OLLAMA_HOST:
        return parse_ref(f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}").display
    return parse_ref(f"{host}/{namespace}/{model}:{tag}").display


def _ollama_model(root: Path, path: Path, name: str) -> OtherModel:
    if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ModelFormatError(f"{path} is not an Ollama manifest")
    layers = parse_manifest(path.read_bytes(), f"Ollama's {name}")
    weights = next(layer for layer in layers if layer.kind == "model")
    return OtherModel(
        tool="ollama",
        name=name,
        origin=str(path),
        weights=(root / "blobs" / weights.digest,),
        size=sum(layer.size for layer in layers),
        layers=tuple(layers),
        blobs=root / "blobs",
        within=root / "blobs",
    )


def _lmstudio_models() -> Iterator[OtherModel]:
    for root in lmstudio_dirs():
        for path in sorted(root.glob("*/*/*.gguf")) if root.is_dir() else []:
            publisher, repo = path.parent.parent.name, path.parent.name
            model = _gguf_model("lmstudio", path, lambda tag, p=publisher, r=repo: f"{p}/{r}:{tag}", root)
            if model is not None:
                yield model


def _hf_models() -> Iterator[OtherModel]:
    cache = hf_cache_dir()
    seen: set[tuple[str, str]] = set()
    for repo_dir in sorted(cache.glob("models--*--*")) if cache.is_dir() else []:
        parts = repo_dir.name.split("--")
        if len(parts) != 3:
            continue
        org, repo = parts[1], parts[2]
        for path in _snapshot_ggufs(repo_dir):
            if (repo_dir.name, path.name) in seen:  # the same file in an older revision
                continue
            seen.add((repo_dir.name, path.name))
            model = _gguf_model("hf", path, lambda tag, o=org, r=repo: f"hf.co/{o}/{r}:{tag}", repo_dir)
            if model is not None:
                yield model


def _snapshot_ggufs(repo_dir: Path) -> list[Path]:
    """The GGUF files of a cached repo, the revision `refs/main` names first."""
    try:
        main = (repo_dir / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    snapshots = sorted((repo_dir / "snapshots").glob("*"), key=lambda folder: folder.name != main)
    return [path for folder in snapshots for path in sorted(folder.glob("*.gguf"))]


def _gguf_model(tool: Tool, path: Path, name_for, within: Path) -> OtherModel | None:
    """A model of one loose GGUF file (every part, for the first part of a split one); None for what is not a model
    on its own: a vision projector, a later part of a split, a file we cannot read."""
    from ..quant.gguf import inspect_gguf, split_parts, split_position

    try:
        info = inspect_gguf(path)
        if info.architecture == "clip" or split_position(info.metadata, path)[0] != 1:
            return None
        parts = tuple(split_parts(path, info.metadata))
        name = name_for(_file_tag(path.name))
        parse_ref(name)
    except (LocalLLMError, OSError) as exc:
        log.warning("skipping %s: %s", path, exc)
        return None
    size = sum(p.stat().st_size for p in parts)
    return OtherModel(tool, parse_ref(name).display, str(path), parts, size, within=within)


def _file_tag(filename: str) -> str:
    """A tag from a GGUF file name (a split's name without its part numbers), within the name grammar."""
    from ..quant.gguf import parse_split_name

    split = parse_split_name(filename)
    stem = split[0] if split else re.sub(r"\.gguf$", "", filename, flags=re.IGNORECASE)
    tag = re.sub(r"[^A-Za-z0-9_.\-]+", "-", stem).strip("-._")[:80].rstrip("-._")
    return tag.lower() or "latest"


# ------------------------------------------------------------------------------------------------------- importing


def imported_from(store: Store, model: OtherModel) -> bool:
    """Whether `model` is already a localllm model made from that same record of the other tool."""
    return (store.source_of(model.name) or {}).get("import") == model.origin


def import_model(model: OtherModel, store: Store, *, link: bool = True) -> Progress:
    """Make `model` a localllm model that references the other tool's files (see the module's docstring).

    Args:
        link: False records the path instead of hard-linking on the same file system (the other tool's `rm` then
            frees the space, and this model reports the file gone).
    Raises:
        InvalidInput: another model (not this import) already has the name, a file leads outside the tool's folder,
            or an adapter is for another architecture.
        IntegrityError: a file's bytes do not match the digest its tool recorded, or it changed while read.
        ModelFormatError: an adapter does not fit the model (as `create` refuses it).
    """
    if store.exists(model.name) and not imported_from(store, model):
        raise InvalidInput(
            f"a model named {model.name!r} is already stored, not imported from {model.origin}",
            hint=f"`localllm rm {model.name}` it first, or `localllm cp` it to another name",
        )
    yield api.PullProgress(status=f"importing {model.name} from {TOOL_NAMES[model.tool]}")
    placed: list[str] = [layer.digest for layer in model.layers]
    try:
        yield from _import(model, store, link, placed)
    except BaseException:
        store.discard_unnamed(placed)  # what this import placed, unless a manifest names it meanwhile
        raise
    yield api.PullProgress(status="success")


def _import(model: OtherModel, store: Store, link: bool, placed: list[str]) -> Progress:
    """import_model's work; each blob it places is added to `placed`, for the caller to remove if it fails."""
    with store.blobs.writing(), ExitStack() as pins:  # safe from `prune` until the manifest names them
        expected = {layer.kind: layer.digest for layer in model.layers}
        weights: list[str] = []
        for path in model.weights:
            weights.append((yield from _reference(store, model, path, expected.get("model"), link, pins)))
            placed.append(weights[-1])
        extras: dict[str, list[str]] = {"adapter": [], "projector": []}
        for layer in model.layers:
            if layer.kind in extras:
                path = _ollama_blob(model, layer)
                extras[layer.kind].append((yield from _reference(store, model, path, layer.digest, link, pins)))
        for digest in extras["adapter"]:
            check_adapter_fits(store.blobs.path(digest), store.blobs.path(weights[0]), model.name, digest)
        fields = model_fields(list(model.layers), lambda layer: _read_small(model, layer), model.origin)
        yield api.PullProgress(status="writing manifest")
        store.write_model(
            model.name,
            weights=weights[0] if len(weights) == 1 else weights,
            adapters=extras["adapter"],
            projectors=extras["projector"],
            source={"import": model.origin, "tool": model.tool},
            **fields,
        )


def _reference(
    store: Store, model: OtherModel, path: Path, digest: str | None, link: bool, pins: ExitStack
) -> Generator[api.PullProgress, None, str]:
    """Blobs.add_reference of a file inside the tool's folder, its hashing shown as progress; returns the digest."""
    total = confined_file(path, model.within).stat().st_size
    hashing = store.blobs.add_reference(path, digest, link=link, pins=pins, within=model.within)
    while True:
        try:
            done = next(hashing)
        except StopIteration as finished:
            return finished.value
        yield api.PullProgress(status=f"hashing {path.name}", digest=digest, total=total, completed=done)


def _ollama_blob(model: OtherModel, layer: Layer) -> Path:
    assert model.blobs is not None
    path = model.blobs / layer.digest
    if not path.is_file():
        raise ModelNotFound(f"Ollama's {model.name} names {layer.digest}, which is not in {model.blobs}")
    return path


def _read_small(model: OtherModel, layer: Layer) -> bytes:
    """A small layer's bytes (parse_manifest bounded its size), from inside Ollama's blobs folder, checked against
    its digest."""
    path = confined_file(_ollama_blob(model, layer), model.within)
    fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)  # a link put there since it was resolved is not followed
    with os.fdopen(fd, "rb") as handle:
        if os.fstat(handle.fileno()).st_size != layer.size:
            raise ModelFormatError(f"Ollama's {model.name}: {path} is not the {layer.size} bytes its manifest says")
        data = handle.read(layer.size + 1)
    if f"sha256-{hashlib.sha256(data).hexdigest()}" != layer.digest:
        raise ModelFormatError(f"Ollama's {model.name}: {path} does not match its digest")
    return data
