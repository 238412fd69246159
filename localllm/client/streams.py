"""A request's chunks as the Client hands them out: iterated on one thread, cancelled from any other.

The request runs as a generator that takes a CancelToken; cancelling sets the token, whose hooks (the engine
request's cancel, a render's check) stop the work wherever it waits, so the generator then ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class CancelToken:
    """Set from any thread; the hooks registered on it (the engine request's cancel) run once, when it is set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled, hooks, self._hooks = True, self._hooks, []
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self.cancelled:
                self._hooks.append(hook)
                return
        hook()


class RequestStream(Generic[T]):
    """A request's chunks (client/protocol.Cancellable): iterate it on one thread, cancel it from any other."""

    def __init__(self, run: Callable[[CancelToken], Iterator[T]]):
        self._token = CancelToken()
        self._chunks = run(self._token)

    def __iter__(self) -> RequestStream[T]:
        return self

    def __next__(self) -> T:
        return next(self._chunks)

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def cancel(self) -> None:
        self._token.cancel()
