"""File operations the store's writes are built from: durable writes (temp file, fsync, rename), hashing in chunks,
removal that reports the bytes it freed, and another tool's files read only from inside that tool's folder."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
from stat import S_ISREG
from typing import BinaryIO

from ..errors import InvalidInput
from .diskspace import disk_full_as_error

CHUNK = 1024 * 1024


def hash_stream(handle: BinaryIO) -> str:
    """The digest (`sha256-<hex>`) of everything left in `handle`."""
    hasher = hashlib.sha256()
    for block in iter(lambda: handle.read(CHUNK), b""):
        hasher.update(block)
    return f"sha256-{hasher.hexdigest()}"


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all: a temp file beside it, synced, then renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with disk_full_as_error(f"writing {path.name}", path.parent, len(data)), temp.open("wb") as out:
            out.write(data)
            sync(out)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def confined_file(path: Path, within: Path | None) -> Path:
    """`path` with every link resolved, which must be a regular file, inside `within` (links resolved too) when
    given. Another tool's folder is read this way: a link in it that leads elsewhere (/etc/passwd, another user's
    files) is refused rather than read, linked or served.

    Raises:
        InvalidInput: no regular file there, or it leads outside `within`.
    """
    resolved = Path(path).expanduser().resolve()
    if within is not None:
        folder = Path(within).expanduser().resolve()
        if not resolved.is_relative_to(folder):
            raise InvalidInput(
                f"{path} leads to {resolved}, outside {folder}; only files inside that folder are imported",
                hint="remove or replace that link in the other tool's folder (pulling the model there fetches it)",
            )
    try:
        found = resolved.lstat()
    except OSError:
        raise InvalidInput(f"no file at {path}") from None
    if not S_ISREG(found.st_mode):
        raise InvalidInput(f"{path} is not a regular file", hint="only plain files are imported")
    return resolved


def sync(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def children(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


def remove(path: Path) -> int:
    """Remove a file, a link or a folder; return the bytes it held (0 if it was gone already)."""
    size = size_of(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return size


def size_of(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return path.lstat().st_size if path.exists() or path.is_symlink() else 0
