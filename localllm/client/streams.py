"""A request's chunks as the Client hands them out (client/protocol.RequestStream): iterated on one thread, cancelled
from any other.

The request runs as a generator that takes a CancelToken; cancelling sets the token, whose hooks (the engine
request's cancel, a render's check, an HTTP response's close) stop the work wherever it waits, so the generator then
ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from typing import Generic, TypeVar

from .protocol import Admission

T = TypeVar("T")


class CancelToken:
    """Set from any thread; the hooks registered on it (the engine request's cancel) run once, when it is set. It
    also carries the stream's admission hook (RequestStream.on_admitted) to the request's generator."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self._admitted: Callable[[Admission], None] | None = None
        self.cancelled = False

    def on_admitted(self, hook: Callable[[Admission], None]) -> None:
        self._admitted = hook

    def admitted(self, admission: Admission) -> None:
        """The engine has taken the request: tell the stream's reader, the first time only."""
        hook, self._admitted = self._admitted, None
        if hook is not None:
            hook(admission)

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


class TokenStream(Generic[T]):
    """A RequestStream (client/protocol.py) over a generator that takes the stream's CancelToken: iterate it on one
    thread, close it there, cancel it from any other."""

    def __init__(self, run: Callable[[CancelToken], Generator[T, None, None]]):
        self._token = CancelToken()
        self._chunks = run(self._token)

    def __iter__(self) -> TokenStream[T]:
        return self

    def __next__(self) -> T:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    def cancel(self) -> None:
        self._token.cancel()

    def on_admitted(self, hook: Callable[[Admission], None]) -> None:
        self._token.on_admitted(hook)


def until_cancelled(chunks: Iterator[T], token: CancelToken) -> Generator[T, None, None]:
    """`chunks` until the token is set, for work that cannot stop midway (a pull, a create): a cancel ends them at
    their next chunk. Closing this generator lets go of `chunks`, which closes them (their clean-up runs then)."""
    for chunk in chunks:
        if token.cancelled:
            return
        yield chunk
