"""Free space: checked before a download starts, and ENOSPC turned into one DiskFull line (what, how much, where)
wherever the store writes, instead of an OSError traceback."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import DiskFull

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def free_bytes(folder: Path) -> int:
    """Free space for an unprivileged writer in `folder` (or the nearest existing folder above it)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Refuse before writing `needed` bytes that cannot fit, rather than fill the disk and fail half-way.

    Raises:
        DiskFull: the free space is below `needed`.
    """
    free = free_bytes(folder)
    if needed > free:
        raise _disk_full(what, folder, needed=needed, free=free)


@contextmanager
def disk_full_as_error(
    what: str, folder: Path, needed: int | None = None, *, written: int | None = None
) -> Iterator[None]:
    """Within the block, a write that finds the disk (or the quota) full raises DiskFull instead of OSError.

    Args:
        needed: the bytes the whole write still needed, when known.
        written: the bytes written before the disk filled up (said when `needed` is unknown).
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        if needed is None and written is not None:
            raise DiskFull(
                f"not enough disk space for {what}: the disk filled up after {size_text(written)} in {folder}",
                hint=_HINT,
            ) from None
        raise _disk_full(what, folder, needed=needed, free=free_bytes(folder)) from None


_HINT = "free some space (`localllm prune` removes unused blobs) or set LOCALLLM_HOME to a larger disk"


def _disk_full(what: str, folder: Path, *, needed: int | None, free: int) -> DiskFull:
    amount = f"needs {size_text(needed)}, " if needed is not None else ""
    return DiskFull(f"not enough disk space for {what}: {amount}{size_text(free)} free in {folder}", hint=_HINT)


def size_text(size: int) -> str:
    """Decimal units, as the CLI prints sizes: 98 MB, 1.2 GB."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit != "GB" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
