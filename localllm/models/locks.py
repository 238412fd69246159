"""Advisory file locks between the processes (and threads) that share one store: the CLI, the server, the TUI.

fcntl's flock fits here because the store needs both kinds it offers: exclusive locks (manifest changes and garbage
collection; one writer per blob) and shared ones (every pull or create in progress, so that `prune` waits for them
instead of collecting a blob that is about to be named), plus a non-blocking try. Each acquisition opens its own file,
so threads of one process exclude each other as separate processes do; a thread that already holds a lock takes it
again without waiting (a pull holds its blob's lock across the download and the manifest write). Windows has no flock:
the locks are then no-ops and the sha256 checks alone guard the bytes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_held = threading.local()  # per thread: {lock path: [depth, shared]}


@contextmanager
def file_lock(path: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold the lock on `path` (created if missing) for the block, waiting for it as long as it takes."""
    with _locked(path, shared=shared, wait=True) as held:
        assert held
        yield


@contextmanager
def try_file_lock(path: Path, *, shared: bool = False) -> Iterator[bool]:
    """Hold the lock on `path` for the block if it is free now; yields False (holding nothing) when it is not."""
    with _locked(path, shared=shared, wait=False) as held:
        yield held


@contextmanager
def _locked(path: Path, *, shared: bool, wait: bool) -> Iterator[bool]:
    holding: dict[str, list] = _held.__dict__.setdefault("holding", {})
    key = str(path)
    if key in holding:  # this thread holds it already
        if holding[key][1] and not shared:
            raise RuntimeError(f"{path} is held shared by this thread; it cannot be upgraded to exclusive")
        holding[key][0] += 1
        try:
            yield True
        finally:
            holding[key][0] -= 1
        return
    with _acquired(path, shared=shared, wait=wait) as held:
        if held:
            holding[key] = [1, shared]
        try:
            yield held
        finally:
            if held:
                del holding[key]


@contextmanager
def _acquired(path: Path, *, shared: bool, wait: bool) -> Iterator[bool]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            import fcntl
        except ImportError:  # Windows
            yield True
            return
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(handle.fileno(), mode)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
