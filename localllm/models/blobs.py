"""The store's bytes: content-addressed blobs, the downloads arriving for them, their corrupt marks and their locks.

Layout under the store's root (see store.py for the manifests beside them)::

    blobs/sha256-<64 hex>                        the bytes; the same bytes are stored once
    blobs/sha256-<64 hex>-partial                a download in progress; the next pull resumes from it
    blobs/<stem>-partial.json                     what a resumed download must match (validator, size)
    corrupt/<digest>                              blobs `verify` found corrupt: a pull re-checks them before trusting
    refs/<digest>                                 a blob held by reference (`add_reference`): blobs/<digest> is then
                                                  a hard link to, or a symlink naming, another tool's file, and this
                                                  JSON records the size and mtime at which its sha256 was checked
    locks/writers.lock                            shared by every pull and create in progress; `prune` takes it whole
    locks/<stem>.lock                             one per blob: one writer, and no collection while it is held
    tmp/<random>/                                 scratch folders for work whose result becomes a blob

A blob is renamed into place only after its sha256 checks, so a blob file is always whole. Removing one is the
store's business (under its store lock, when no manifest names it); `remove_unheld` refuses blobs a writer holds.
Files of other tools (Ollama's, LM Studio's, the Hugging Face cache) become blobs without a copy: a hard link when on
the same file system, else a symlink; either is re-hashed when its size or mtime moves (the other tool may write the
file in place). Either way only our own name is ever removed, never the other tool's file. A blob `verify` marked
corrupt is never served (`check_served`) until a pull or `verify --repair` replaces it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Generator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import BinaryIO

from ..errors import DiskFull, IntegrityError, InvalidInput
from .diskspace import check_free_space, disk_full_as_error
from .files import CHUNK, atomic_write, children, confined_file, hash_stream, remove, sync
from .locks import file_lock, try_file_lock
from .names import parse_digest

BLOB_NAME = re.compile(r"^sha256-[0-9a-f]{64}$")


@dataclass(frozen=True)
class Reference:
    """A blob that is another tool's file: where, and the size and mtime its sha256 was last checked at (None:
    never, so the next check re-hashes)."""

    path: Path
    size: int | None
    mtime_ns: int | None


class Blobs:
    def __init__(self, root: Path):
        self.dir = root / "blobs"
        self.locks_dir = root / "locks"
        self.corrupt_dir = root / "corrupt"
        self.refs_dir = root / "refs"
        self.scratch_root = root / "tmp"

    # ------------------------------------------------------------------------------------------------- locks

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Held (shared) by a pull or create from its first new blob until its manifest is written, so that `prune`
        never collects a blob that is about to be named."""
        with file_lock(self.locks_dir / "writers.lock", shared=True):
            yield

    @contextmanager
    def pin(self, digest: str) -> Iterator[None]:
        """Hold one blob: a second pull of it waits here, and no collection removes it while held."""
        with self.writing(), file_lock(self.lock_path(parse_digest(digest))):
            yield

    def lock_path(self, stem: str) -> Path:
        return self.locks_dir / f"{stem}.lock"

    def remove_locks(self) -> None:
        """Remove every blob's lock file. Safe only while holding the writers lock whole (`prune`): every holder of
        a blob lock holds the writers lock first."""
        for path in children(self.locks_dir):
            if path.suffix == ".lock" and path.name not in ("store.lock", "writers.lock"):
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------------- reading

    def path(self, digest: str) -> Path:
        return self.dir / parse_digest(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def has_trusted(self, digest: str, size: int | None = None) -> bool:
        """The blob is there with the expected size, and re-hashes clean if `verify` found it corrupt before."""
        path = self.path(digest)
        if not path.is_file() or (size is not None and path.stat().st_size != size):
            return False
        try:
            self.check_reference(digest)
        except IntegrityError:
            return False
        if not self.marked_corrupt(digest):
            return True
        if self.check(digest) is not None:
            return False
        self.mark_corrupt(digest, False)
        return True

    def partials(self) -> list[Path]:
        """Partial downloads kept to be resumed (a pull of the same source continues them; `prune` removes them)."""
        return [path for path in children(self.dir) if path.name.endswith("-partial")]

    # ------------------------------------------------------------------------------------------------- adding

    def add_file(self, path: Path) -> str:
        """Copy a file into the blobs (hashing as it goes) and return its digest; known bytes are not stored twice."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise InvalidInput(f"no file at {path}")
        size = path.stat().st_size
        self.dir.mkdir(parents=True, exist_ok=True)
        check_free_space(self.dir, size, f"a copy of {path}")
        with self.writing(), path.open("rb") as source, disk_full_as_error(f"a copy of {path}", self.dir, size):
            return self._add_stream(source)

    def add_upload(self, digest: str, source: BinaryIO) -> str:
        """Store the bytes a client uploads under the digest it names (Ollama's POST /api/blobs/:digest).

        Raises:
            InvalidName: the digest is not one.
            InvalidInput: the bytes have another sha256 (nothing is kept).
        """
        with self.open_partial(digest) as partial:
            if partial.done:
                return partial.digest or digest
            partial.restart()  # an upload always starts at its first byte
            for block in iter(lambda: source.read(CHUNK), b""):
                partial.write(block)
            try:
                return partial.commit("the upload")
            except IntegrityError as exc:
                raise InvalidInput(
                    f"the uploaded bytes do not match {parse_digest(digest)}: {exc.message}",
                    hint="upload the file whose sha256 the URL names",
                ) from None

    def adopt(self, path: Path) -> str:
        """Move a finished file (written inside the store's root, so the rename stays on one filesystem) into the
        blobs; return its digest. Used for what we make ourselves (a quantized model), to avoid copying gigabytes."""
        with Path(path).open("rb") as handle:
            digest = hash_stream(handle)
        if self.has(digest):
            Path(path).unlink()
        else:
            os.replace(path, self.path(digest))
        return digest

    def scratch_dir(self) -> Path:
        """A fresh folder under the root for work whose result becomes a blob (removed by the caller)."""
        folder = self.scratch_root / uuid.uuid4().hex
        folder.mkdir(parents=True)
        return folder

    def add_bytes(self, data: bytes) -> str:
        digest = f"sha256-{hashlib.sha256(data).hexdigest()}"
        if not self.has_trusted(digest):
            atomic_write(self.path(digest), data)
            self.mark_corrupt(digest, False)
            self.forget_reference(digest)
        return digest

    def add_reference(
        self,
        path: Path,
        digest: str | None = None,
        *,
        link: bool = True,
        pins: ExitStack | None = None,
        within: Path | None = None,
    ) -> Generator[int, None, str]:
        """Make another tool's file a blob without copying it, and return its digest; yields the bytes hashed so far.

        A hard link when `link` and the file is on this file system (its bytes are hashed through the link), else
        a symlink; either way a record of the file's size and mtime (check_reference re-hashes it when they change).
        Bytes already stored intact are kept as they are. The file itself is only read. The blob's lock is entered
        on `pins` (held until the caller's manifest names it), else held only while the blob is placed.

        Args:
            within: the other tool's folder: `path`, its links resolved, must be a regular file inside it.
        Raises:
            InvalidInput: there is no regular file at `path`, or it leads outside `within`.
            IntegrityError: the bytes do not hash to `digest`, or the file changed while it was read (nothing kept).
        """
        source = confined_file(path, within)
        expected = source.stat()
        if digest is not None and pins is not None:
            pins.enter_context(file_lock(self.lock_path(parse_digest(digest))))
        if digest is not None and self.has_trusted(digest, expected.st_size):
            return parse_digest(digest)  # stored intact already (pulled, or imported before)
        self.dir.mkdir(parents=True, exist_ok=True)
        temp = self.dir / f".tmp-{uuid.uuid4().hex}"
        try:
            linked = link and _hard_link(source, temp)
            if linked and not _same_file(temp.lstat(), expected):
                raise InvalidInput(  # swapped for a link (or another file) after it was checked
                    f"{source} was replaced while it was imported", hint="import again once it stays put"
                )
            if not linked:
                temp.symlink_to(source)
            before = source.stat()
            actual = yield from _hash_file(temp)
            after = source.stat()
            if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
                raise IntegrityError(f"{source} changed while it was read", hint="try again once it is written")
            if digest is not None and actual != parse_digest(digest):
                raise IntegrityError(
                    f"{source} is named {parse_digest(digest)} but its bytes hash to {actual}",
                    hint="the file is damaged; the tool that wrote it can fetch it again",
                )
            with ExitStack() as held:
                (pins or held).enter_context(file_lock(self.lock_path(actual)))
                if not self.has_trusted(actual):
                    self._record_reference(actual, Reference(source, after.st_size, after.st_mtime_ns))
                    os.replace(temp, self.path(actual))
                    self.mark_corrupt(actual, False)
            return actual
        finally:
            temp.unlink(missing_ok=True)

    @contextmanager
    def open_partial(self, digest: str | None, *, key: str = "", size: int | None = None) -> Iterator[PartialBlob]:
        """A blob being written, locked against other writers; see PartialBlob.

        Args:
            digest: the expected digest, or None when the source does not say (the bytes then name the blob).
            key: names the partial file when the digest is unknown (e.g. the URL), so a retry resumes it.
            size: the expected size in bytes, when known.
        """
        digest = parse_digest(digest) if digest is not None else None
        stem = digest or f"download-{hashlib.sha256(key.encode()).hexdigest()[:32]}"
        with self.writing(), file_lock(self.lock_path(stem)), ExitStack() as pins:
            partial = PartialBlob(
                self, digest, self.dir / f"{stem}-partial", size, pins=pins, label=key or digest or stem
            )
            try:
                partial.ensure_room()
                yield partial
            except DiskFull:
                partial.discard()  # never leave the disk full
                raise
            except BaseException:
                if not partial.resumable:
                    partial.discard()
                raise
            finally:
                partial.close()
                if not partial.done and partial.completed == 0:
                    partial.discard()  # nothing received: no empty file left behind

    def _add_stream(self, source: BinaryIO) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        temp = self.dir / f".tmp-{uuid.uuid4().hex}"
        hasher = hashlib.sha256()
        try:
            with temp.open("wb") as out:
                for block in iter(lambda: source.read(CHUNK), b""):
                    hasher.update(block)
                    out.write(block)
                sync(out)
            digest = f"sha256-{hasher.hexdigest()}"
            if self.has(digest):
                temp.unlink()
            else:
                os.replace(temp, self.path(digest))
            return digest
        finally:
            temp.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------------- checking

    def check(self, digest: str) -> str | None:
        """None when the blob re-hashes to its digest, else what is wrong with it. A blob held by reference that
        checks clean has its record brought up to date."""
        path = self.path(digest)
        ref = self.reference(digest) or self._linked(digest)
        if not path.is_file():
            return f"blob {digest} is {ref.path}, which is gone" if ref else f"blob {digest} is missing"
        stat = path.stat()
        with path.open("rb") as handle:
            actual = hash_stream(handle)
        if actual != digest:
            if ref is not None:
                return f"blob {digest} is {ref.path}, which changed since it was imported (it hashes to {actual})"
            return f"blob {digest} is corrupt (its bytes hash to {actual})"
        if ref is not None:
            self._record_reference(digest, Reference(ref.path, stat.st_size, stat.st_mtime_ns))
        return None

    def reference(self, digest: str) -> Reference | None:
        """The other tool's file a symlinked blob names, or None for a blob that is a file here (our own bytes, or
        a hard link to another tool's file: see `_linked`)."""
        path = self.path(digest)
        if not path.is_symlink():
            return None
        return self._read_record(digest) or Reference(Path(os.readlink(path)), None, None)  # no record: re-hash

    def _linked(self, digest: str) -> Reference | None:
        """The record of a blob hard-linked to another tool's file, which that tool may still write in place."""
        return None if self.path(digest).is_symlink() else self._read_record(digest)

    def _read_record(self, digest: str) -> Reference | None:
        try:
            record = json.loads((self.refs_dir / parse_digest(digest)).read_text())
            return Reference(Path(record["path"]), int(record["size"]), int(record["mtime_ns"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def check_served(self, digest: str) -> None:
        """Before a blob is loaded or its text served: it is not marked corrupt, and a blob held by reference
        still has the bytes it was imported with (check_reference).

        Raises:
            IntegrityError: marked corrupt by `verify`, or another tool's file that is gone or changed.
        """
        self.check_reference(digest)
        if self.marked_corrupt(digest):
            raise IntegrityError(
                f"blob {parse_digest(digest)} was found corrupt by `localllm verify`, so it is not used",
                hint="run `localllm verify --repair` to fetch it again (an imported model: import it again), "
                "or `localllm rm` the model",
            )

    def check_reference(self, digest: str) -> None:
        """For a blob held by reference (a symlink, or a hard link to another tool's file), make sure its file is
        still there with the same bytes: a file whose size or mtime moved is re-hashed (other bytes are marked
        corrupt, as `verify` would).

        Raises:
            IntegrityError: the file is gone, is no longer a plain file at its path, or now holds other bytes.
        """
        ref = self.reference(digest)
        if ref is not None:
            stat = _referenced_stat(parse_digest(digest), ref)
        else:
            ref = self._linked(digest)
            try:
                stat = self.path(digest).stat()  # the same inode as the other tool's file
            except OSError:
                return  # missing: the caller says so
            if ref is None:
                return
        if (stat.st_size, stat.st_mtime_ns) == (ref.size, ref.mtime_ns):
            return
        problem = self.check(digest)
        if problem:
            self.mark_corrupt(digest, True)
            raise IntegrityError(problem, hint="import the model again, or `localllm rm` it")

    def _record_reference(self, digest: str, ref: Reference) -> None:
        record = {"path": str(ref.path), "size": ref.size, "mtime_ns": ref.mtime_ns}
        atomic_write(self.refs_dir / parse_digest(digest), json.dumps(record).encode())

    def forget_reference(self, digest: str) -> None:
        """The blob is now bytes of our own: no other tool's file to watch."""
        (self.refs_dir / parse_digest(digest)).unlink(missing_ok=True)

    def marked_corrupt(self, digest: str) -> bool:
        return (self.corrupt_dir / parse_digest(digest)).exists()

    def mark_corrupt(self, digest: str, corrupt: bool) -> None:
        marker = self.corrupt_dir / parse_digest(digest)
        if corrupt:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------------- removing

    def remove_unheld(self, digest: str) -> int:
        """Remove a blob no writer holds (and its corrupt mark); the bytes freed. Call with the store lock held."""
        with try_file_lock(self.lock_path(digest)) as free:
            if not free:  # a pull that holds it is about to name it; `prune` collects it later if not
                return 0
            freed = remove(self.path(digest))  # a link: only our name goes, never the file it names
            self.mark_corrupt(digest, False)
            (self.refs_dir / parse_digest(digest)).unlink(missing_ok=True)
            return freed

    def unneeded(self, named: set[str]) -> list[Path]:
        """What `prune` removes here: blobs, corrupt marks and reference records no manifest names (a reference's
        link, never its file), records of blobs no longer there, temp files, partial downloads."""
        found = [
            path
            for path in children(self.dir)
            if is_leftover(path.name) or (BLOB_NAME.match(path.name) and path.name not in named)
        ]
        found += [
            path
            for path in children(self.refs_dir)
            if not BLOB_NAME.match(path.name) or path.name not in named or not os.path.lexists(self.path(path.name))
        ]
        return found + [path for path in children(self.corrupt_dir) if path.name not in named]


class PartialBlob:
    """Bytes arriving for one blob. They are appended to a `-partial` file that survives a crash; `completed` says
    where a resumed download starts. Beside it, `-partial.json` keeps what those bytes must match to be resumed:
    the source's validator (a strong ETag or Last-Modified) and the total size. `commit()` checks size and sha256,
    then renames the file into place."""

    def __init__(
        self,
        blobs: Blobs,
        digest: str | None,
        path: Path,
        size: int | None,
        *,
        pins: ExitStack | None = None,
        label: str = "",
    ):
        self.blobs = blobs
        self.digest = digest
        self.path = path
        self.meta_path = path.with_name(path.name + ".json")
        self.size = size
        self.label = label or path.name
        self.validator: str | None = None
        self.done = digest is not None and blobs.has_trusted(digest, size)
        self._pins = pins
        self._hasher = hashlib.sha256()
        self._file: BinaryIO | None = None
        self.completed = 0 if self.done else self._resume()

    @property
    def resumable(self) -> bool:
        """Whether the bytes kept can be continued later: a pinned digest or a recorded validator proves them."""
        return self.completed > 0 and (self.digest is not None or self.validator is not None)

    def _resume(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._read_meta()
        if self.path.exists() and self.size is not None and self.path.stat().st_size > self.size:
            self.path.unlink()  # longer than the blob can be: not worth trusting
        file = self._file = self.path.open("a+b")
        file.seek(0)
        for block in iter(lambda: file.read(CHUNK), b""):
            self._hasher.update(block)
        return file.tell()

    def _read_meta(self) -> None:
        try:
            meta = json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(meta.get("validator"), str):
            self.validator = meta["validator"]
        if self.size is None and isinstance(meta.get("size"), int):
            self.size = meta["size"]

    def remember(self, validator: str | None, size: int | None) -> None:
        """Record what the source said at the start of a full download, for a later resume to compare against."""
        self.validator = validator
        if size is not None and (self.size is None or self.digest is None):
            self.size = size
        with disk_full_as_error(f"pulling {self.label}", self.path.parent):
            atomic_write(self.meta_path, json.dumps({"validator": validator, "size": self.size}).encode())

    def ensure_room(self) -> None:
        """Refuse now, before any byte is written, when the rest of the blob cannot fit on the disk."""
        if self.size is not None and not self.done:
            check_free_space(self.path.parent, self.size - self.completed, f"pulling {self.label}")

    def restart(self) -> None:
        """Drop what was received (the source could not resume where we stopped, or its file changed)."""
        assert self._file is not None
        self._file.truncate(0)
        self._file.seek(0)
        self._hasher = hashlib.sha256()
        self.completed = 0
        self.validator = None
        if self.digest is None:
            self.size = None  # a URL's size is learned again from the response
        self.meta_path.unlink(missing_ok=True)

    def write(self, data: bytes) -> None:
        """Append `data`. Bytes past the declared size are never written: a source that sends more is refused at
        once (not after writing all it sends), and what it sent is discarded.

        Raises:
            IntegrityError: `data` would run past the declared size.
        """
        assert self._file is not None, "the blob is already stored"
        if self.size is not None and self.completed + len(data) > self.size:
            self.discard()
            raise IntegrityError(
                f"pulling {self.label}: the source sent more than the {self.size} bytes declared for it; "
                "reading stopped there and the download was discarded",
                hint="pull again; if it keeps failing the source is serving other bytes",
            )
        with disk_full_as_error(
            f"pulling {self.label}", self.path.parent, self._still_needed(), written=self.completed
        ):
            self._file.write(data)
        self._hasher.update(data)
        self.completed += len(data)

    def _still_needed(self) -> int | None:
        return self.size - self.completed if self.size is not None else None

    def commit(self, source: str = "") -> str:
        """Check the bytes and move them into place; return the digest. A mismatch discards them. A blob learned
        only now (no digest was known) is pinned until the open_partial block ends, so its manifest can be written.

        Raises:
            IntegrityError: the size or the sha256 is not the one expected (the message names `source`).
        """
        if self.done:
            return self.digest or ""
        assert self._file is not None
        with disk_full_as_error(
            f"pulling {self.label}", self.path.parent, self._still_needed(), written=self.completed
        ):
            sync(self._file)
        actual = f"sha256-{self._hasher.hexdigest()}"
        problem = self._mismatch(actual)
        if problem:
            self.discard()
            raise IntegrityError(
                f"{problem}{' from ' + source if source else ''}; the download was discarded",
                hint="pull again; if it keeps failing the source is serving other bytes",
            )
        self.close()
        if self._pins is not None and self.digest is None:
            self._pins.enter_context(file_lock(self.blobs.lock_path(actual)))
        if self.blobs.has(actual) and not self.blobs.marked_corrupt(actual):
            self.path.unlink()
        else:  # new, or replacing a corrupt copy in place (models that name it are whole again)
            os.replace(self.path, self.blobs.path(actual))
            self.blobs.mark_corrupt(actual, False)
            self.blobs.forget_reference(actual)
        self.meta_path.unlink(missing_ok=True)
        self.done, self.digest = True, actual
        return actual

    def _mismatch(self, actual: str) -> str | None:
        if self.size is not None and self.completed != self.size:
            return f"received {self.completed} bytes, expected {self.size}"
        if self.digest and actual != self.digest:
            return f"sha256 mismatch: expected {self.digest}, got {actual}"
        return None

    def discard(self) -> None:
        """Remove the bytes received and what was recorded about them."""
        try:
            self.close()
        except OSError:  # flushing the buffered tail failed (a full disk): those bytes are being dropped anyway
            self._file = None
        self.path.unlink(missing_ok=True)
        self.meta_path.unlink(missing_ok=True)
        self.completed = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def is_leftover(name: str) -> bool:
    """A temp file of an interrupted write, or a partial download with its notes."""
    return name.startswith(".") and ".tmp-" in name or name.endswith(("-partial", "-partial.json"))


def _hard_link(source: Path, link: Path) -> bool:
    """Whether `link` now names the same file as `source` (False across file systems, or where links are refused).
    A symlink put at `source` meanwhile is linked as itself, never followed (the caller compares the inode)."""
    try:
        os.link(source, link, follow_symlinks=False)
    except OSError:
        return False
    return True


def _same_file(linked: os.stat_result, expected: os.stat_result) -> bool:
    return S_ISREG(linked.st_mode) and (linked.st_dev, linked.st_ino) == (expected.st_dev, expected.st_ino)


def _referenced_stat(digest: str, ref: Reference) -> os.stat_result:
    """The stat of a symlinked blob's file, which must still be a plain file at the very path recorded (a link put
    there since would lead the blob elsewhere).

    Raises:
        IntegrityError: the file is gone, or its path now leads through a link.
    """
    try:
        found = ref.path.lstat()
    except OSError:
        raise IntegrityError(
            f"blob {digest} is the file {ref.path}, which is gone",
            hint="the tool that owned it removed it: import the model again, or `localllm rm` it",
        ) from None
    if not S_ISREG(found.st_mode) or ref.path.resolve() != ref.path:
        raise IntegrityError(
            f"blob {digest} is the file {ref.path}, which is now a link to {ref.path.resolve()}",
            hint="import the model again, or `localllm rm` it",
        )
    return found


def _hash_file(path: Path) -> Generator[int, None, str]:
    """The digest of a file, yielding the bytes read so far every few chunks."""
    hasher = hashlib.sha256()
    done = 0
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            hasher.update(block)
            done += len(block)
            if done % (64 * CHUNK) < CHUNK:
                yield done
    yield done
    return f"sha256-{hasher.hexdigest()}"
