"""The model store: JSON manifests that name content-addressed blobs. No network here (pull.py fetches).

Layout under the root (`LOCALLLM_HOME/models` by default); the blobs, their partial downloads, corrupt marks and
locks are blobs.py's::

    manifests/<host>/<namespace>/<name>/<tag>   JSON: config (format, cached details) + layers (media type, digest)
    blobs/ corrupt/ refs/ tmp/ locks/<stem>.lock see blobs.py (refs: blobs that are other tools' files)
    mlx/<manifest digest>/                        an MLX model's files as symlinks to its blobs, built on demand
    split/<digest of the parts>/                  a split GGUF's parts as symlinks named as gguf-split names them
                                                  (llama.cpp finds the parts by name), built on demand
    locks/store.lock                              exclusive: manifest changes and garbage collection

Crash safety comes from the order of writes: a blob is renamed into place only after its sha256 checks, and a
manifest (written to a temp file, then renamed) only after all its blobs exist. A kill at any moment therefore never
leaves a listed model with a missing or corrupt blob. Races between processes are settled by the locks (locks.py): a
blob is removed only under the store lock, when no manifest names it and no pull holds it. Every name and digest is
validated (names.py) before a path is built from it."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from .. import api, config
from ..errors import IntegrityError, InvalidInput, InvalidName, ModelFormatError, ModelNotFound
from .blobs import Blobs
from .catalog import did_you_mean, find_entry, with_default_tag
from .files import atomic_write, children, remove, size_of
from .locks import file_lock, try_file_lock
from .names import ModelRef, parse_digest, parse_ref

MANIFEST_MEDIA = "application/vnd.localllm.manifest.v1+json"
MEDIA_GGUF = "application/vnd.localllm.model.gguf"
MEDIA_MLX = "application/vnd.localllm.model.mlx"  # one layer per file, with its relative "name"
MEDIA_TEMPLATE = "application/vnd.localllm.template"
MEDIA_SYSTEM = "application/vnd.localllm.system"
MEDIA_PARAMS = "application/vnd.localllm.params+json"
MEDIA_MESSAGES = "application/vnd.localllm.messages+json"
MEDIA_LICENSE = "application/vnd.localllm.license"
MEDIA_DRAFT = "application/vnd.localllm.draft"
MEDIA_ADAPTER = "application/vnd.localllm.adapter"  # with its "scale" (default 1)
MEDIA_QUALITY = "application/vnd.localllm.quantization-report+json"
MEDIA_PROJECTOR = "application/vnd.localllm.projector"  # a vision projector (a `clip` GGUF) the model reads images with

WEIGHT_MEDIA = {"gguf": MEDIA_GGUF, "mlx": MEDIA_MLX}
MAX_SPLIT_PARTS = 9999  # gguf-split numbers parts with five digits
# What write_model takes as weights: a GGUF digest, a split GGUF's digests in part order, or MLX {file: digest}.
Weights = str | list[str] | dict[str, str]
_MLX_FILE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True)
class Replaced:
    """A manifest that a copy (or a write) replaced, and the bytes its unshared blobs gave back."""

    name: str
    digest: str
    freed: int


@dataclass(frozen=True)
class ResolvedModel:
    """Everything a backend and a surface need about one stored model (or a .gguf path)."""

    name: str
    digest: str
    weights: Path
    format: str
    template: str | None = None  # None: the weights' own chat template applies
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[api.Message] = field(default_factory=list)
    license: str | None = None
    draft: str | None = None
    adapters: list[api.LoraAdapter] = field(default_factory=list)
    projector: Path | None = None  # the vision projector: images become embeddings the model reads
    parts: list[Path] = field(default_factory=list)  # every weights file: a split GGUF's parts, in order
    quality: api.QuantizationReport | None = None
    size: int = 0
    modified_at: datetime = field(default_factory=api.now)
    details: api.ModelDetails = field(default_factory=api.ModelDetails)


@dataclass(frozen=True)
class _Manifest:
    ref: ModelRef
    data: dict[str, Any]
    digest: str
    modified_at: datetime

    @property
    def layers(self) -> list[dict[str, Any]]:
        return self.data.get("layers", [])

    @property
    def format(self) -> str:
        return self.data.get("config", {}).get("format", "gguf")

    def layers_of(self, media: str) -> list[dict[str, Any]]:
        return [layer for layer in self.layers if layer.get("mediaType") == media]

    @property
    def size(self) -> int:
        return sum(int(layer.get("size", 0)) for layer in self.layers)


class Store:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else config.models_dir()
        self.manifests_dir = self.root / "manifests"
        self.mlx_dir = self.root / "mlx"
        self.split_dir = self.root / "split"
        self.locks_dir = self.root / "locks"
        self.blobs = Blobs(self.root)

    # ------------------------------------------------------------------------------------------------- locks

    @contextmanager
    def lock(self) -> Iterator[None]:
        """The store-wide lock: every manifest change and every blob removal happens inside it (held briefly)."""
        with file_lock(self.locks_dir / "store.lock"):
            yield

    # ------------------------------------------------------------------------------------------------- reading

    def resolve(self, name: str) -> ResolvedModel:
        """The stored model `name`, or the .gguf file `name` points at.

        Raises:
            InvalidName: the name breaks the grammar.
            ModelNotFound: nothing is stored under that name (the hint says how to pull it).
        """
        ref = self._ref(name)
        if ref.kind == "file":
            return _resolve_file(ref)
        return self._resolve_manifest(self._read_manifest(ref))

    def exists(self, name: str) -> bool:
        ref = self._ref(name)
        if ref.kind == "file":
            return ref.path is not None and ref.path.is_file()
        return self._manifest_path(ref).is_file()

    def list(self) -> list[api.ModelSummary]:
        """Every stored model, newest first; details come from the manifest, so no weights file is opened."""
        rows = []
        for manifest in self._all_manifests():
            rows.append(
                api.ModelSummary(
                    name=manifest.ref.display,
                    model=manifest.ref.display,
                    modified_at=manifest.modified_at,
                    size=manifest.size,
                    digest=manifest.digest.removeprefix("sha256-"),
                    details=self._details(manifest),
                )
            )
        return sorted(rows, key=lambda row: row.modified_at, reverse=True)

    def weights_of(self, name: str) -> tuple[str, Weights]:
        """(format, weights) of a stored model in the form write_model takes: a digest, a split GGUF's digests in
        order, or {file name: digest}."""
        manifest = self._read_manifest(parse_ref(name))
        if manifest.format == "mlx":
            return "mlx", {layer["name"]: layer["digest"] for layer in manifest.layers_of(MEDIA_MLX)}
        self._weights_path(manifest)  # every GGUF layer present
        digests = [layer["digest"] for layer in manifest.layers_of(MEDIA_GGUF)]
        return "gguf", digests[0] if len(digests) == 1 else digests

    def adapter_layers(self, name: str) -> builtins.list[tuple[str, float]]:
        """(digest, scale) of each adapter of a stored model, as write_model takes them."""
        return [
            (layer["digest"], float(layer.get("scale", 1.0)))
            for layer in self._read_manifest(parse_ref(name)).layers_of(MEDIA_ADAPTER)
        ]

    def projector_layers(self, name: str) -> builtins.list[str]:
        """The digest of a stored model's vision projector (none, or one), as write_model takes it."""
        return [layer["digest"] for layer in self._read_manifest(parse_ref(name)).layers_of(MEDIA_PROJECTOR)]

    def manifest_digest(self, name: str) -> str | None:
        """The id of the manifest stored under `name` now (None when there is none): what a loaded model compares
        with to notice it was removed or replaced by another process."""
        try:
            return self._read_manifest(parse_ref(name)).digest
        except (ModelNotFound, ModelFormatError, InvalidName):
            return None

    def still_names(self, name: str, digest: str) -> bool:
        """Whether `name` still stands for the model whose id is `digest` (a path: whether the file is there)."""
        try:
            ref = parse_ref(name)
        except InvalidName:
            return False
        if ref.kind == "file":
            return ref.path is not None and ref.path.is_file()
        try:
            return self.manifest_digest(name) == digest
        except OSError:  # unreadable just now: not proof that it is gone
            return True

    def source_of(self, name: str) -> dict[str, Any] | None:
        """Where a stored model was pulled from ({"url": ...}), when its pull recorded it."""
        try:
            return self._read_manifest(parse_ref(name)).data.get("config", {}).get("source")
        except (ModelNotFound, ModelFormatError, InvalidName):
            return None

    # ------------------------------------------------------------------------------------------------- changing

    def delete(self, name: str) -> int:
        """Remove a model's manifest, then the blobs no other manifest references; return the bytes freed."""
        ref = parse_ref(name)
        with self.lock():
            path = self._manifest_path(ref)
            try:
                manifest: _Manifest | None = self._read_manifest(ref)
            except ModelFormatError:  # a broken manifest can still be removed; `prune` collects its blobs
                manifest = None
            path.unlink()
            _remove_empty_parents(path.parent, stop=self.manifests_dir)
            return self._collect(manifest) if manifest is not None else 0

    def copy(self, source: str, destination: str) -> Replaced | None:
        """Store the same manifest under a second name (same bytes, so the same id). A model already stored under
        `destination` is replaced (as Ollama does) and returned, its unshared blobs collected."""
        target = parse_ref(destination)
        with self.lock():
            manifest = self._read_manifest(parse_ref(source))
            return self._write_manifest(target, manifest.data)

    def _write_manifest(self, ref: ModelRef, data: dict[str, Any]) -> Replaced | None:
        """Write a manifest whose blobs all exist (checked here, under the store lock, so none can be dangling);
        collect what a replaced manifest no longer shares. Call with the store lock held."""
        for layer in data.get("layers", []):
            if not self.blobs.has(layer["digest"]):
                raise IntegrityError(
                    f"blob {layer['digest']} of {ref.display!r} is no longer in the store",
                    hint="another process removed it meanwhile; pull or create the model again",
                )
        path = self._manifest_path(ref)
        try:
            old: _Manifest | None = self._read_manifest(ref) if path.is_file() else None
        except ModelFormatError:
            old = None
        atomic_write(path, _manifest_bytes(data))
        if old is None:
            return None
        freed = self._collect(old) if old.digest != self._read_manifest(ref).digest else 0
        return Replaced(old.ref.display, old.digest, freed)

    def _collect(self, gone: _Manifest) -> int:
        """Remove the blobs of a manifest that was just deleted or replaced which no manifest names now and no pull
        holds; return the bytes freed. Call with the store lock held."""
        named, manifest_digests = self._named()
        freed = 0
        for digest in {layer["digest"] for layer in gone.layers} - named:
            freed += self.blobs.remove_unheld(digest)
        if gone.digest not in manifest_digests:
            shutil.rmtree(self.mlx_dir / gone.digest, ignore_errors=True)
        parts = [layer["digest"] for layer in gone.layers_of(MEDIA_GGUF)]
        if len(parts) > 1 and not all(self.blobs.has(digest) for digest in parts):
            # the set is gone: its part names too
            shutil.rmtree(self._split_folder(parts), ignore_errors=True)
        return freed

    def discard_unnamed(self, digests: Sequence[str]) -> int:
        """Remove those of `digests` that no manifest names and no writer holds (what a failed pull or import
        placed); return the bytes freed."""
        with self.lock():
            named = self._named()[0]
            return sum(self.blobs.remove_unheld(digest) for digest in set(digests) - named)

    def _named(self) -> tuple[set[str], set[str]]:
        """(every blob digest some manifest names, every manifest digest)."""
        manifests = list(self._all_manifests())
        return {layer["digest"] for m in manifests for layer in m.layers}, {m.digest for m in manifests}

    def write_model(
        self,
        name: str,
        *,
        weights: Weights,
        fmt: str = "gguf",
        template: str | None = None,
        system: str | None = None,
        parameters: dict[str, Any] | None = None,
        messages: builtins.list[Any] | None = None,
        license: str | builtins.list[str] | None = None,
        draft: str | None = None,
        adapters: Sequence[str | tuple[str, float]] | None = None,
        projectors: Sequence[str] = (),
        details: api.ModelDetails | None = None,
        source: dict[str, Any] | None = None,
        quality: api.QuantizationReport | None = None,
    ) -> ResolvedModel:
        """Write (or replace) the manifest of `name` from blobs already in the store.

        Args:
            weights: the GGUF blob's digest, a split GGUF's digests in part order, or for MLX a mapping
                {relative file name: digest}.
            fmt: "gguf" or "mlx".
            messages: api.Message objects or dicts.
            draft: a model name, kept as a reference (the draft's weights are resolved when loading).
            adapters: each LoRA adapter blob's digest, or (digest, scale) for a scale other than 1.
            projectors: the vision projector's blob (a `clip` GGUF), at most one.
            details: cached for `list`; read from the GGUF metadata when not given.
            source: where the weights came from ({"url": ...}), kept in the manifest's config.
            quality: the quantization report of a model made by `create --quantize`.
        """
        ref = parse_ref(name)
        if len(projectors) > 1:
            raise InvalidInput(f"{name} names {len(projectors)} vision projectors; a model takes at most one")
        with self.lock():  # the blobs checked here cannot be collected before the manifest names them
            layers = self._weight_layers(weights, fmt)
            layers += self._extra_layers(
                template=template,
                system=system,
                parameters=parameters,
                messages=messages,
                license=license,
                draft=draft,
                adapters=adapters,
                quality=quality,
            )
            layers += [self._layer(MEDIA_PROJECTOR, digest) for digest in projectors]
            if details is None and fmt == "gguf":
                details = _inspect_details(self._gguf_parts(ref.display, layers)[0])
            model_config: dict[str, Any] = {"format": fmt}
            if details is not None:
                model_config["details"] = details.model_dump(mode="json")
            if source:
                model_config["source"] = source
            data = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA, "config": model_config, "layers": layers}
            self._write_manifest(ref, data)
        return self.resolve(ref.display)

    # ------------------------------------------------------------------------------------------------- checking

    def verify(self, name: str | None = None) -> builtins.list[str]:
        """Re-hash the blobs of one model (or all); return one line per problem, [] when everything is intact."""
        manifests = [self._read_manifest(parse_ref(name))] if name else list(self._all_manifests())
        problems: list[str] = []
        checked: dict[str, str | None] = {}
        for manifest in manifests:
            for layer in manifest.layers:
                digest = layer["digest"]
                if digest not in checked:
                    checked[digest] = self.blobs.check(digest)
                    if self.blobs.has(digest):
                        self.blobs.mark_corrupt(digest, checked[digest] is not None)
                if checked[digest]:
                    problems.append(f"{manifest.ref.display}: {checked[digest]}")
        return problems

    # ------------------------------------------------------------------------------------------------- collecting

    def prune(self, *, dry_run: bool = False, on_wait: Callable[[], None] | None = None) -> api.PruneReport:
        """Remove what no model needs: blobs no manifest names, partial downloads, temp files of interrupted writes,
        MLX folders of removed models. Waits for pulls and creates in progress (calling `on_wait` first), so nothing
        they write is taken."""
        writers = self.locks_dir / "writers.lock"
        with try_file_lock(writers) as free:
            if free:
                return self._prune(dry_run)
        if on_wait is not None:
            on_wait()
        with file_lock(writers):
            return self._prune(dry_run)

    def _prune(self, dry_run: bool) -> api.PruneReport:
        with self.lock():
            named, manifest_digests = self._named()
            doomed = self.blobs.unneeded(named)
            doomed += [path for path in children(self.mlx_dir) if path.name not in manifest_digests]
            doomed += (
                [path for path in self.manifests_dir.rglob(".*") if ".tmp-" in path.name]
                if self.manifests_dir.is_dir()
                else []
            )
            report = api.PruneReport(
                removed=[str(p.relative_to(self.root)) for p in doomed],
                freed=sum(size_of(p) for p in doomed),
                dry_run=dry_run,
            )
            if not dry_run:
                for path in doomed:
                    remove(path)
                self.blobs.remove_locks()
            return report

    def damaged(self, name: str | None = None) -> dict[str, builtins.list[str]]:
        """{digest: the models naming it} for each missing blob and each blob `verify` marked corrupt."""
        manifests = [self._read_manifest(parse_ref(name))] if name else list(self._all_manifests())
        found: dict[str, list[str]] = {}
        for manifest in manifests:
            for digest in dict.fromkeys(layer["digest"] for layer in manifest.layers):
                if not self.blobs.has(digest) or self.blobs.marked_corrupt(digest):
                    found.setdefault(digest, []).append(manifest.ref.display)
        return found

    # ------------------------------------------------------------------------------------------------- internals

    def _ref(self, name: str) -> ModelRef:
        """The parsed name; a catalog name without a tag means the catalog's default tag unless stored as is."""
        return with_default_tag(parse_ref(name), lambda ref: self._manifest_path(ref).is_file())

    def _manifest_path(self, ref: ModelRef) -> Path:
        return self.manifests_dir.joinpath(*ref.manifest_parts)

    def stored_names(self) -> builtins.list[str]:
        """The names of every stored model, without reading a manifest."""
        refs = (
            _ref_from_manifest_path(path.relative_to(self.manifests_dir))
            for path in sorted(self.manifests_dir.glob("*/*/*/*"))
            if path.is_file()
        )
        return [ref.display for ref in refs if ref is not None]

    def _read_manifest(self, ref: ModelRef) -> _Manifest:
        path = self._manifest_path(ref)
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            suggestion = None if find_entry(ref) else did_you_mean(ref.display, self.stored_names())
            raise ModelNotFound(
                f"model {ref.display!r} not found", hint=suggestion or f"pull it with `localllm pull {ref.display}`"
            ) from None
        try:
            data = json.loads(raw)
        except ValueError:
            raise ModelFormatError(
                f"the manifest of {ref.display!r} at {path} is not valid JSON",
                hint=f"remove it with `localllm rm {ref.display}` and pull again",
            ) from None
        modified = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc)
        return _Manifest(ref, data, f"sha256-{hashlib.sha256(raw).hexdigest()}", modified)

    def _all_manifests(self) -> Iterator[_Manifest]:
        for path in sorted(self.manifests_dir.glob("*/*/*/*")):
            ref = _ref_from_manifest_path(path.relative_to(self.manifests_dir))
            if ref is not None and path.is_file():
                try:
                    yield self._read_manifest(ref)
                except ModelFormatError:
                    continue

    def _resolve_manifest(self, manifest: _Manifest) -> ResolvedModel:
        texts = {
            media: [self._read_text(manifest, layer) for layer in manifest.layers_of(media)]
            for media in (
                MEDIA_TEMPLATE,
                MEDIA_SYSTEM,
                MEDIA_PARAMS,
                MEDIA_MESSAGES,
                MEDIA_LICENSE,
                MEDIA_DRAFT,
                MEDIA_QUALITY,
            )
        }
        parts = self._weight_parts(manifest)
        quality = _last(texts[MEDIA_QUALITY])
        return ResolvedModel(
            name=manifest.ref.display,
            digest=manifest.digest,
            weights=parts[0],
            parts=parts,
            quality=api.QuantizationReport.model_validate_json(quality) if quality else None,
            format=manifest.format,
            template=_last(texts[MEDIA_TEMPLATE]),
            system=_last(texts[MEDIA_SYSTEM]),
            parameters=json.loads(_last(texts[MEDIA_PARAMS]) or "{}"),
            messages=[api.Message.model_validate(m) for m in json.loads(_last(texts[MEDIA_MESSAGES]) or "[]")],
            license="\n\n".join(texts[MEDIA_LICENSE]) or None,
            draft=_last(texts[MEDIA_DRAFT]),
            adapters=[
                api.LoraAdapter(
                    path=str(self._existing_blob(manifest, layer["digest"])), scale=float(layer.get("scale", 1.0))
                )
                for layer in manifest.layers_of(MEDIA_ADAPTER)
            ],
            projector=next(
                (self._existing_blob(manifest, layer["digest"]) for layer in manifest.layers_of(MEDIA_PROJECTOR)), None
            ),
            size=manifest.size,
            modified_at=manifest.modified_at,
            details=self._details(manifest),
        )

    def _read_text(self, manifest: _Manifest, layer: dict[str, Any]) -> str:
        return self._existing_blob(manifest, layer["digest"]).read_text(encoding="utf-8")

    def _existing_blob(self, manifest: _Manifest, digest: str) -> Path:
        path = self.blobs.path(digest)
        try:
            self.blobs.check_served(digest)  # not found corrupt; another tool's file: still the same bytes
        except IntegrityError as exc:
            raise IntegrityError(f"model {manifest.ref.display!r}: {exc.message}", hint=exc.hint) from None
        if not path.is_file():
            raise IntegrityError(
                f"model {manifest.ref.display!r}: blob {digest} is missing",
                hint=f"pull or create {manifest.ref.display} again",
            )
        return path

    def _weights_path(self, manifest: _Manifest) -> Path:
        return self._weight_parts(manifest)[0]

    def _weight_parts(self, manifest: _Manifest) -> builtins.list[Path]:
        for layer in manifest.layers_of(MEDIA_MLX if manifest.format == "mlx" else MEDIA_GGUF):
            self._existing_blob(manifest, layer["digest"])
        if manifest.format == "mlx":
            return [self._materialise_mlx(manifest)]
        return self._gguf_parts(manifest.ref.display, manifest.layers_of(MEDIA_GGUF))

    def _gguf_parts(self, label: str, layers: builtins.list[dict[str, Any]]) -> builtins.list[Path]:
        """The GGUF file(s) of a model: its blob, or for a split GGUF symlinks named as its parts (llama.cpp's loader
        opens the first part and finds the others by name)."""
        digests = [layer["digest"] for layer in layers if layer.get("mediaType", MEDIA_GGUF) == MEDIA_GGUF]
        if not digests:
            raise ModelFormatError(f"the manifest of {label!r} has no GGUF layer")
        if len(digests) == 1:
            return [self.blobs.path(digests[0])]
        from ..quant.gguf import split_part_name

        folder = self._split_folder(digests)
        names = [split_part_name("model", i + 1, len(digests)) for i in range(len(digests))]
        if not folder.is_dir():
            building = self.split_dir / f".tmp-{uuid.uuid4().hex}"
            building.mkdir(parents=True)
            for name, digest in zip(names, digests):
                (building / name).symlink_to(os.path.relpath(self.blobs.path(digest), building))
            try:
                building.rename(folder)
            except OSError:  # built meanwhile by another process: theirs is identical
                shutil.rmtree(building, ignore_errors=True)
        return [folder / name for name in names]

    def _split_folder(self, digests: builtins.list[str]) -> Path:
        return self.split_dir / hashlib.sha256("\n".join(digests).encode()).hexdigest()[:32]

    def _materialise_mlx(self, manifest: _Manifest) -> Path:
        """The MLX folder of a manifest: symlinks named as the model's files, pointing at the blobs."""
        folder = self.mlx_dir / manifest.digest
        if folder.is_dir():
            return folder
        building = self.mlx_dir / f".tmp-{uuid.uuid4().hex}"
        for layer in manifest.layers_of(MEDIA_MLX):
            link = building / _safe_relative(layer["name"])
            link.parent.mkdir(parents=True, exist_ok=True)
            blob = self._existing_blob(manifest, layer["digest"])
            link.symlink_to(os.path.relpath(blob, link.parent))
        try:
            building.rename(folder)
        except OSError:  # built meanwhile by another process: theirs is identical
            shutil.rmtree(building, ignore_errors=True)
        return folder

    def _details(self, manifest: _Manifest) -> api.ModelDetails:
        cached = manifest.data.get("config", {}).get("details")
        if cached is not None:
            return api.ModelDetails.model_validate(cached)
        if manifest.format == "gguf":
            try:
                return _inspect_details(self._weights_path(manifest))
            except ModelFormatError:  # verified bytes we cannot describe: loading them will say why
                pass
        return api.ModelDetails(format=manifest.format)

    def _weight_layers(self, weights: Weights, fmt: str) -> builtins.list[dict[str, Any]]:
        if fmt not in WEIGHT_MEDIA:
            raise InvalidInput(f"weights format {fmt!r} is not one of {', '.join(WEIGHT_MEDIA)}")
        if fmt == "gguf":
            if isinstance(weights, list) and 1 <= len(weights) <= MAX_SPLIT_PARTS:  # bounded like gguf.py's reader
                return [self._layer(MEDIA_GGUF, digest) for digest in weights]
            if not isinstance(weights, str):
                raise InvalidInput("GGUF weights are one blob digest, or a split GGUF's digests in order")
            return [self._layer(MEDIA_GGUF, weights)]
        if not isinstance(weights, dict) or not weights:
            raise InvalidInput("MLX weights are a mapping {relative file name: digest}")
        return [
            dict(self._layer(MEDIA_MLX, digest), name=str(_safe_relative(rel)))
            for rel, digest in sorted(weights.items())
        ]

    def _extra_layers(
        self, *, template, system, parameters, messages, license, draft, adapters, quality
    ) -> builtins.list[dict[str, Any]]:
        texts: list[tuple[str, str | None]] = [(MEDIA_TEMPLATE, template), (MEDIA_SYSTEM, system)]
        if parameters:
            texts.append((MEDIA_PARAMS, json.dumps(parameters, sort_keys=True)))
        if messages:
            dumped = [api.Message.model_validate(m).model_dump(mode="json", exclude_none=True) for m in messages]
            texts.append((MEDIA_MESSAGES, json.dumps(dumped)))
        licenses = [license] if isinstance(license, str) else list(license or [])
        texts += [(MEDIA_LICENSE, text) for text in licenses]
        if draft:
            texts.append((MEDIA_DRAFT, parse_ref(draft).display))
        if quality is not None:
            texts.append((MEDIA_QUALITY, quality.model_dump_json()))
        layers = [
            self._layer(media, self.blobs.add_bytes(text.encode("utf-8"))) for media, text in texts if text is not None
        ]
        pairs = [(item, 1.0) if isinstance(item, str) else item for item in adapters or []]
        return layers + [
            dict(self._layer(MEDIA_ADAPTER, digest), **({"scale": scale} if scale != 1.0 else {}))
            for digest, scale in pairs
        ]

    def _layer(self, media: str, digest: str) -> dict[str, Any]:
        path = self.blobs.path(digest)
        if not path.is_file():
            raise InvalidInput(
                f"blob {parse_digest(digest)} is not in the store", hint="add it first (pull or add_blob_from_file)"
            )
        return {"mediaType": media, "digest": parse_digest(digest), "size": path.stat().st_size}


# ---------------------------------------------------------------------------------------------------- helpers


def _resolve_file(ref: ModelRef) -> ResolvedModel:
    path = ref.path.resolve() if ref.path else None
    if path is None or not path.is_file():
        raise ModelNotFound(f"no GGUF file at {ref.path}")
    stat = path.stat()
    # A path has no manifest: its id names the file as it is now, without hashing gigabytes on every resolve.
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    from ..quant.gguf import split_parts

    return ResolvedModel(
        name=str(path),
        digest=f"sha256-{hashlib.sha256(identity).hexdigest()}",
        weights=path,
        format="gguf",
        parts=split_parts(path),
        size=stat.st_size,
        modified_at=datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc),
        details=_inspect_details(path),
    )


def _inspect_details(path: Path) -> api.ModelDetails:
    from ..quant.gguf import inspect_gguf

    return inspect_gguf(path).details()


def _ref_from_manifest_path(relative: Path) -> ModelRef | None:
    """The name a manifest file stands for, or None for anything that is not one (temp files, strays)."""
    host, namespace, name, tag = relative.parts
    if tag.startswith("."):
        return None
    host = re.sub(r"_(\d{1,5})$", r":\1", host)
    if host == "hf.co":
        text = f"hf.co/{namespace}/{name}" + ("" if tag == "latest" else f":{tag}")
    else:
        text = f"{host}/{namespace}/{name}:{tag}"
    try:
        return parse_ref(text)
    except InvalidName:
        return None


def _safe_relative(name: str) -> PurePosixPath:
    """A file name inside an MLX folder: relative, no `..`, plain characters only."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or not all(_MLX_FILE_PART.match(part) for part in rel.parts):
        raise InvalidName(
            f"file name {name!r} in an MLX model is not valid",
            hint="use relative paths of letters, digits, '.', '-' and '_'",
        )
    return rel


def _manifest_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode("utf-8")


def _remove_empty_parents(folder: Path, *, stop: Path) -> None:
    while folder != stop and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def _last(values: list[str]) -> str | None:
    return values[-1] if values else None
