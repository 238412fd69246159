"""The model store: JSON manifests that name content-addressed blobs. No network here (pull.py fetches).

Layout under the root (`LOCALLLM_HOME/models` by default)::

    manifests/<host>/<namespace>/<name>/<tag>   JSON: config (format, cached details) + layers (media type, digest)
    blobs/sha256-<64 hex>                        the bytes; the same bytes are stored once
    blobs/sha256-<64 hex>-partial                a download in progress; the next pull resumes from it
    mlx/<manifest digest>/                        an MLX model's files as symlinks to its blobs, built on demand
    split/<digest of the parts>/                  a split GGUF's parts as symlinks named as gguf-split names them
                                                  (llama.cpp finds the parts by name), built on demand
    locks/                                        one lock file per blob being written (several pulls, one writer)

Crash safety comes from the order of writes: a blob is renamed into place only after its sha256 checks, and a
manifest (written to a temp file, then renamed) only after all its blobs exist. A kill at any moment therefore never
leaves a listed model with a missing or corrupt blob. Every name and digest is validated (names.py) before a path is
built from it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Iterator, Optional, Union

from .. import api, config
from ..errors import IntegrityError, InvalidInput, InvalidName, ModelFormatError, ModelNotFound
from .names import ModelRef, parse_digest, parse_ref

MANIFEST_MEDIA = "application/vnd.localllm.manifest.v1+json"
MEDIA_GGUF = "application/vnd.localllm.model.gguf"
MEDIA_MLX = "application/vnd.localllm.model.mlx"          # one layer per file, with its relative "name"
MEDIA_TEMPLATE = "application/vnd.localllm.template"
MEDIA_SYSTEM = "application/vnd.localllm.system"
MEDIA_PARAMS = "application/vnd.localllm.params+json"
MEDIA_MESSAGES = "application/vnd.localllm.messages+json"
MEDIA_LICENSE = "application/vnd.localllm.license"
MEDIA_DRAFT = "application/vnd.localllm.draft"
MEDIA_ADAPTER = "application/vnd.localllm.adapter"         # with its "scale" (default 1)
MEDIA_QUALITY = "application/vnd.localllm.quantization-report+json"

WEIGHT_MEDIA = {"gguf": MEDIA_GGUF, "mlx": MEDIA_MLX}
MAX_SPLIT_PARTS = 9999  # gguf-split numbers parts with five digits
# What write_model takes as weights: a GGUF digest, a split GGUF's digests in part order, or MLX {file: digest}.
Weights = Union[str, list[str], dict[str, str]]
CHUNK = 1024 * 1024
_MLX_FILE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True)
class ResolvedModel:
    """Everything a backend and a surface need about one stored model (or a .gguf path)."""

    name: str
    digest: str
    weights: Path
    format: str
    template: Optional[str] = None          # None: the weights' own chat template applies
    system: Optional[str] = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[api.Message] = field(default_factory=list)
    license: Optional[str] = None
    draft: Optional[str] = None
    adapters: list[api.LoraAdapter] = field(default_factory=list)
    parts: list[Path] = field(default_factory=list)  # every weights file: a split GGUF's parts, in order
    quality: Optional[api.QuantizationReport] = None
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
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.mlx_dir = self.root / "mlx"
        self.split_dir = self.root / "split"
        self.locks_dir = self.root / "locks"

    # ------------------------------------------------------------------------------------------------- reading

    def resolve(self, name: str) -> ResolvedModel:
        """The stored model `name`, or the .gguf file `name` points at.

        Raises:
            InvalidName: the name breaks the grammar.
            ModelNotFound: nothing is stored under that name (the hint says how to pull it).
        """
        ref = parse_ref(name)
        if ref.kind == "file":
            return _resolve_file(ref)
        return self._resolve_manifest(self._read_manifest(ref))

    def exists(self, name: str) -> bool:
        ref = parse_ref(name)
        if ref.kind == "file":
            return ref.path is not None and ref.path.is_file()
        return self._manifest_path(ref).is_file()

    def list(self) -> list[api.ModelSummary]:
        """Every stored model, newest first; details come from the manifest, so no weights file is opened."""
        rows = []
        for manifest in self._all_manifests():
            rows.append(api.ModelSummary(
                name=manifest.ref.display, model=manifest.ref.display, modified_at=manifest.modified_at,
                size=manifest.size, digest=manifest.digest.removeprefix("sha256-"),
                details=self._details(manifest)))
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

    def adapter_layers(self, name: str) -> list[tuple[str, float]]:
        """(digest, scale) of each adapter of a stored model, as write_model takes them."""
        return [(layer["digest"], float(layer.get("scale", 1.0)))
                for layer in self._read_manifest(parse_ref(name)).layers_of(MEDIA_ADAPTER)]

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / parse_digest(digest)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    # ------------------------------------------------------------------------------------------------- changing

    def delete(self, name: str) -> None:
        """Remove a model's manifest, then the blobs no other manifest references."""
        manifest = self._read_manifest(parse_ref(name))
        path = self._manifest_path(manifest.ref)
        path.unlink()
        _remove_empty_parents(path.parent, stop=self.manifests_dir)
        still_used = {layer["digest"] for other in self._all_manifests() for layer in other.layers}
        for layer in manifest.layers:
            if layer["digest"] not in still_used:
                self.blob_path(layer["digest"]).unlink(missing_ok=True)
        shutil.rmtree(self.mlx_dir / manifest.digest, ignore_errors=True)
        split = [layer["digest"] for layer in manifest.layers_of(MEDIA_GGUF)]
        if len(split) > 1 and not all(self.has_blob(digest) for digest in split):
            shutil.rmtree(self._split_folder(split), ignore_errors=True)

    def copy(self, source: str, destination: str) -> None:
        """Store the same manifest under a second name (same bytes, so the same id)."""
        manifest = self._read_manifest(parse_ref(source))
        target = parse_ref(destination)
        _atomic_write(self._manifest_path(target), _manifest_bytes(manifest.data))

    def add_blob_from_file(self, path: Path) -> str:
        """Copy a file into the blobs (hashing as it goes) and return its digest; known bytes are not stored twice."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise InvalidInput(f"no file at {path}")
        with path.open("rb") as source:
            return self._add_blob_from_stream(source)

    def adopt_blob(self, path: Path) -> str:
        """Move a finished file (written inside the store's root, so the rename stays on one filesystem) into the
        blobs; return its digest. Used for what we make ourselves (a quantized model), to avoid copying gigabytes."""
        with Path(path).open("rb") as handle:
            digest = _hash_stream(handle)
        if self.has_blob(digest):
            Path(path).unlink()
        else:
            os.replace(path, self.blob_path(digest))
        return digest

    def scratch_dir(self) -> Path:
        """A fresh folder under the root for work whose result becomes a blob (removed by the caller)."""
        folder = self.root / "tmp" / uuid.uuid4().hex
        folder.mkdir(parents=True)
        return folder

    def add_blob_from_bytes(self, data: bytes) -> str:
        digest = f"sha256-{hashlib.sha256(data).hexdigest()}"
        if not self.has_blob(digest):
            _atomic_write(self.blob_path(digest), data)
        return digest

    @contextmanager
    def open_partial(self, digest: Optional[str], *, key: str = "", size: Optional[int] = None
                     ) -> Iterator["PartialBlob"]:
        """A blob being written, locked against other writers; see PartialBlob.

        Args:
            digest: the expected digest, or None when the source does not say (the bytes then name the blob).
            key: names the partial file when the digest is unknown (e.g. the URL), so a retry resumes it.
            size: the expected size in bytes, when known.
        """
        digest = parse_digest(digest) if digest is not None else None
        stem = digest or f"download-{hashlib.sha256(key.encode()).hexdigest()[:32]}"
        with _file_lock(self.locks_dir / f"{stem}.lock"):
            partial = PartialBlob(self, digest, self.blobs_dir / f"{stem}-partial", size)
            try:
                yield partial
            finally:
                partial.close()

    def write_model(self, name: str, *, weights: Weights, fmt: str = "gguf",
                    template: Optional[str] = None, system: Optional[str] = None,
                    parameters: Optional[dict[str, Any]] = None, messages: Optional[list] = None,
                    license: Union[str, list[str], None] = None, draft: Optional[str] = None,
                    adapters: Optional[list[Union[str, tuple[str, float]]]] = None,
                    details: Optional[api.ModelDetails] = None,
                    quality: Optional[api.QuantizationReport] = None) -> ResolvedModel:
        """Write (or replace) the manifest of `name` from blobs already in the store.

        Args:
            weights: the GGUF blob's digest, a split GGUF's digests in part order, or for MLX a mapping
                {relative file name: digest}.
            fmt: "gguf" or "mlx".
            messages: api.Message objects or dicts.
            draft: a model name, kept as a reference (the draft's weights are resolved when loading).
            adapters: each LoRA adapter blob's digest, or (digest, scale) for a scale other than 1.
            details: cached for `list`; read from the GGUF metadata when not given.
            quality: the quantization report of a model made by `create --quantize`.
        """
        ref = parse_ref(name)
        path = self._manifest_path(ref)
        layers = self._weight_layers(weights, fmt)
        layers += self._extra_layers(template=template, system=system, parameters=parameters, messages=messages,
                                     license=license, draft=draft, adapters=adapters, quality=quality)
        if details is None and fmt == "gguf":
            details = _inspect_details(self._gguf_parts(ref.display, layers)[0])
        model_config: dict[str, Any] = {"format": fmt}
        if details is not None:
            model_config["details"] = details.model_dump(mode="json")
        data = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA, "config": model_config, "layers": layers}
        _atomic_write(path, _manifest_bytes(data))
        return self.resolve(ref.display)

    # ------------------------------------------------------------------------------------------------- checking

    def verify(self, name: Optional[str] = None) -> list[str]:
        """Re-hash the blobs of one model (or all); return one line per problem, [] when everything is intact."""
        manifests = [self._read_manifest(parse_ref(name))] if name else list(self._all_manifests())
        problems: list[str] = []
        checked: dict[str, Optional[str]] = {}
        for manifest in manifests:
            for layer in manifest.layers:
                digest = layer["digest"]
                if digest not in checked:
                    checked[digest] = self._check_blob(digest)
                if checked[digest]:
                    problems.append(f"{manifest.ref.display}: {checked[digest]}")
        return problems

    def _check_blob(self, digest: str) -> Optional[str]:
        path = self.blob_path(digest)
        if not path.is_file():
            return f"blob {digest} is missing"
        with path.open("rb") as handle:
            actual = _hash_stream(handle)
        if actual != digest:
            return f"blob {digest} is corrupt (its bytes hash to {actual})"
        return None

    # ------------------------------------------------------------------------------------------------- internals

    def _manifest_path(self, ref: ModelRef) -> Path:
        return self.manifests_dir.joinpath(*ref.manifest_parts)

    def _read_manifest(self, ref: ModelRef) -> _Manifest:
        path = self._manifest_path(ref)
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ModelNotFound(f"model {ref.display!r} not found",
                                hint=f"pull it with `localllm pull {ref.display}`") from None
        try:
            data = json.loads(raw)
        except ValueError:
            raise ModelFormatError(f"the manifest of {ref.display!r} at {path} is not valid JSON",
                                   hint=f"remove it with `localllm rm {ref.display}` and pull again") from None
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
        texts = {media: [self._read_text(manifest, layer) for layer in manifest.layers_of(media)]
                 for media in (MEDIA_TEMPLATE, MEDIA_SYSTEM, MEDIA_PARAMS, MEDIA_MESSAGES, MEDIA_LICENSE,
                               MEDIA_DRAFT, MEDIA_QUALITY)}
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
            adapters=[api.LoraAdapter(path=str(self._existing_blob(manifest, layer["digest"])),
                                      scale=float(layer.get("scale", 1.0)))
                      for layer in manifest.layers_of(MEDIA_ADAPTER)],
            size=manifest.size,
            modified_at=manifest.modified_at,
            details=self._details(manifest),
        )

    def _read_text(self, manifest: _Manifest, layer: dict[str, Any]) -> str:
        return self._existing_blob(manifest, layer["digest"]).read_text(encoding="utf-8")

    def _existing_blob(self, manifest: _Manifest, digest: str) -> Path:
        path = self.blob_path(digest)
        if not path.is_file():
            raise IntegrityError(f"model {manifest.ref.display!r}: blob {digest} is missing",
                                 hint=f"pull or create {manifest.ref.display} again")
        return path

    def _weights_path(self, manifest: _Manifest) -> Path:
        return self._weight_parts(manifest)[0]

    def _weight_parts(self, manifest: _Manifest) -> list[Path]:
        if manifest.format == "mlx":
            return [self._materialise_mlx(manifest)]
        for layer in manifest.layers_of(MEDIA_GGUF):
            self._existing_blob(manifest, layer["digest"])
        return self._gguf_parts(manifest.ref.display, manifest.layers_of(MEDIA_GGUF))

    def _gguf_parts(self, label: str, layers: list[dict[str, Any]]) -> list[Path]:
        """The GGUF file(s) of a model: its blob, or for a split GGUF symlinks named as its parts (llama.cpp's loader
        opens the first part and finds the others by name)."""
        digests = [layer["digest"] for layer in layers if layer.get("mediaType", MEDIA_GGUF) == MEDIA_GGUF]
        if not digests:
            raise ModelFormatError(f"the manifest of {label!r} has no GGUF layer")
        if len(digests) == 1:
            return [self.blob_path(digests[0])]
        from ..formats.gguf import split_part_name

        folder = self._split_folder(digests)
        names = [split_part_name("model", i + 1, len(digests)) for i in range(len(digests))]
        if not folder.is_dir():
            building = self.split_dir / f".tmp-{uuid.uuid4().hex}"
            building.mkdir(parents=True)
            for name, digest in zip(names, digests):
                (building / name).symlink_to(os.path.relpath(self.blob_path(digest), building))
            try:
                building.rename(folder)
            except OSError:  # built meanwhile by another process: theirs is identical
                shutil.rmtree(building, ignore_errors=True)
        return [folder / name for name in names]

    def _split_folder(self, digests: list[str]) -> Path:
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

    def _weight_layers(self, weights: Weights, fmt: str) -> list[dict[str, Any]]:
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
        return [dict(self._layer(MEDIA_MLX, digest), name=str(_safe_relative(rel)))
                for rel, digest in sorted(weights.items())]

    def _extra_layers(self, *, template, system, parameters, messages, license, draft, adapters, quality
                      ) -> list[dict[str, Any]]:
        texts: list[tuple[str, Optional[str]]] = [(MEDIA_TEMPLATE, template), (MEDIA_SYSTEM, system)]
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
        layers = [self._layer(media, self.add_blob_from_bytes(text.encode("utf-8")))
                  for media, text in texts if text is not None]
        pairs = [(item, 1.0) if isinstance(item, str) else item for item in adapters or []]
        return layers + [dict(self._layer(MEDIA_ADAPTER, digest), **({"scale": scale} if scale != 1.0 else {}))
                         for digest, scale in pairs]

    def _layer(self, media: str, digest: str) -> dict[str, Any]:
        path = self.blob_path(digest)
        if not path.is_file():
            raise InvalidInput(f"blob {parse_digest(digest)} is not in the store",
                               hint="add it first (pull or add_blob_from_file)")
        return {"mediaType": media, "digest": parse_digest(digest), "size": path.stat().st_size}

    def _add_blob_from_stream(self, source: BinaryIO) -> str:
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        temp = self.blobs_dir / f".tmp-{uuid.uuid4().hex}"
        hasher = hashlib.sha256()
        try:
            with temp.open("wb") as out:
                for block in iter(lambda: source.read(CHUNK), b""):
                    hasher.update(block)
                    out.write(block)
                _sync(out)
            digest = f"sha256-{hasher.hexdigest()}"
            if self.has_blob(digest):
                temp.unlink()
            else:
                os.replace(temp, self.blob_path(digest))
            return digest
        finally:
            temp.unlink(missing_ok=True)


class PartialBlob:
    """Bytes arriving for one blob. They are appended to a `-partial` file that survives a crash; `completed` says
    where a resumed download starts. `commit()` checks size and sha256, then renames the file into place."""

    def __init__(self, store: Store, digest: Optional[str], path: Path, size: Optional[int]):
        self.store = store
        self.digest = digest
        self.path = path
        self.size = size
        self.done = bool(digest) and store.has_blob(digest)
        self._hasher = hashlib.sha256()
        self._file: Optional[BinaryIO] = None
        self.completed = 0 if self.done else self._resume()

    def _resume(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.size is not None and self.path.stat().st_size > self.size:
            self.path.unlink()  # longer than the blob can be: not worth trusting
        self._file = self.path.open("a+b")
        self._file.seek(0)
        for block in iter(lambda: self._file.read(CHUNK), b""):
            self._hasher.update(block)
        return self._file.tell()

    def restart(self) -> None:
        """Drop what was received (the source could not resume where we stopped)."""
        assert self._file is not None
        self._file.truncate(0)
        self._file.seek(0)
        self._hasher = hashlib.sha256()
        self.completed = 0

    def write(self, data: bytes) -> None:
        assert self._file is not None, "the blob is already stored"
        self._file.write(data)
        self._hasher.update(data)
        self.completed += len(data)

    def commit(self, source: str = "") -> str:
        """Check the bytes and move them into place; return the digest. A mismatch discards them.

        Raises:
            IntegrityError: the size or the sha256 is not the one expected (the message names `source`).
        """
        if self.done:
            return self.digest or ""
        assert self._file is not None
        _sync(self._file)
        actual = f"sha256-{self._hasher.hexdigest()}"
        problem = self._mismatch(actual)
        if problem:
            self.close()
            self.path.unlink(missing_ok=True)
            raise IntegrityError(f"{problem}{' from ' + source if source else ''}; the download was discarded",
                                 hint="pull again; if it keeps failing the source is serving other bytes")
        self.close()
        if self.store.has_blob(actual):
            self.path.unlink()
        else:
            os.replace(self.path, self.store.blob_path(actual))
        self.done, self.digest = True, actual
        return actual

    def _mismatch(self, actual: str) -> Optional[str]:
        if self.size is not None and self.completed != self.size:
            return f"received {self.completed} bytes, expected {self.size}"
        if self.digest and actual != self.digest:
            return f"sha256 mismatch: expected {self.digest}, got {actual}"
        return None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------------------- helpers

def _resolve_file(ref: ModelRef) -> ResolvedModel:
    path = ref.path.resolve() if ref.path else None
    if path is None or not path.is_file():
        raise ModelNotFound(f"no GGUF file at {ref.path}")
    stat = path.stat()
    # A path has no manifest: its id names the file as it is now, without hashing gigabytes on every resolve.
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    from ..formats.gguf import split_parts

    return ResolvedModel(
        name=str(path), digest=f"sha256-{hashlib.sha256(identity).hexdigest()}", weights=path, format="gguf",
        parts=split_parts(path),
        size=stat.st_size, modified_at=datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc),
        details=_inspect_details(path))


def _inspect_details(path: Path) -> api.ModelDetails:
    from ..formats.gguf import inspect_gguf

    return inspect_gguf(path).details()


def _ref_from_manifest_path(relative: Path) -> Optional[ModelRef]:
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
        raise InvalidName(f"file name {name!r} in an MLX model is not valid",
                          hint="use relative paths of letters, digits, '.', '-' and '_'")
    return rel


def _hash_stream(handle: BinaryIO) -> str:
    hasher = hashlib.sha256()
    for block in iter(lambda: handle.read(CHUNK), b""):
        hasher.update(block)
    return f"sha256-{hasher.hexdigest()}"


def _manifest_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode("utf-8")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with temp.open("wb") as out:
            out.write(data)
            _sync(out)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def _sync(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _remove_empty_parents(folder: Path, *, stop: Path) -> None:
    while folder != stop and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def _last(values: list[str]) -> Optional[str]:
    return values[-1] if values else None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes (several pulls of one blob wait for the first; then find it stored)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; the sha256 check still guards the result
            yield
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
