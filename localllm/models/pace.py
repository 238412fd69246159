"""How long a pull may wait on a server (LOCALLLM_PULL_TIMEOUT): a manifest must arrive whole within it, and a
download must bring at least 1 MiB (or what is left of the file) in every span of that length. A read timeout alone
never ends a server that drips one byte every few seconds."""

from __future__ import annotations

import time

from .. import config

MIN_BYTES = 1 << 20


class Deadline:
    """The moment a whole read must be done by."""

    def __init__(self, seconds: float | None = None):
        self.seconds = config.PULL_TIMEOUT.get() if seconds is None else seconds
        self._end = time.monotonic() + self.seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() > self._end


class RateFloor:
    """A download's minimum pace: `too_slow(completed)` is true once a span of the timeout brought fewer bytes than
    MIN_BYTES (or than what was left of the file at the span's start)."""

    def __init__(self, completed: int, size: int | None):
        self.seconds = config.PULL_TIMEOUT.get()
        self._size = size
        self._start(completed)

    def _start(self, completed: int) -> None:
        self._from = completed
        self.needed = MIN_BYTES if self._size is None else min(MIN_BYTES, self._size - completed)
        self._span = Deadline(self.seconds)

    def too_slow(self, completed: int) -> bool:
        if not self._span.passed:
            return False
        if completed - self._from < self.needed:
            return True
        self._start(completed)
        return False
