"""The bridge from the client's blocking chunk iterators to the event loop.

`Client.generate` / `Client.chat` return plain iterators that block while the engine works, so each `next()` runs in a
worker thread. The first chunk is pulled before any response starts: an error that comes before output (unknown
model, context overflow, full queue) raises from `ChunkStream.open` and becomes a real HTTP status. Closing the stream
closes the client's iterator, which cancels the request in the engine and frees its slot."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, Iterator, Optional, TypeVar

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar

from .. import api

log = logging.getLogger(__name__)

T = TypeVar("T")
_END = object()

# Waiting for a token is not CPU work; a dedicated limiter keeps many slow streams from starving the default thread
# pool that FastAPI uses for plain `def` handlers. One per event loop, as anyio keeps its own default limiter.
_STREAM_THREADS: RunVar[anyio.CapacityLimiter] = RunVar("localllm_stream_threads")


def _stream_threads() -> anyio.CapacityLimiter:
    try:
        return _STREAM_THREADS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(512)
        _STREAM_THREADS.set(limiter)
        return limiter


def _next_or_end(iterator: Iterator[Any]) -> Any:
    return next(iterator, _END)


def _close_iterator(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


class ChunkStream(Generic[T]):
    """A client iterator driven from async code. Iterate it once; `aclose()` is idempotent and always safe."""

    def __init__(self, iterator: Iterator[T], first: Any, observe: Optional[Callable[[T], None]]):
        self._iterator = iterator
        self._first = first
        self._observe = observe
        self._closed = False

    @classmethod
    async def open(cls, make: Callable[[], Iterator[T]], *,
                   observe: Optional[Callable[[T], None]] = None) -> "ChunkStream[T]":
        """Start the request and wait for its first chunk; errors before any output raise here."""
        iterator = await anyio.to_thread.run_sync(make, limiter=_stream_threads())
        stream = cls(iterator, _END, observe)
        try:
            stream._first = await stream._pull()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def _pull(self) -> Any:
        chunk = await anyio.to_thread.run_sync(_next_or_end, self._iterator, limiter=_stream_threads())
        if chunk is not _END and self._observe is not None:
            self._observe(chunk)
        return chunk

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            chunk, self._first = self._first, _END
            while chunk is not _END:
                yield chunk
                chunk = await self._pull()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shielded: this runs when the client has gone and the task is being cancelled, which is exactly when the
        # engine must hear about it.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_close_iterator, self._iterator, limiter=_stream_threads())

    async def collect(self, *, disconnected: Optional[Callable[[], Awaitable[bool]]] = None) -> Optional[list[T]]:
        """All chunks, for a non-streamed answer. With `disconnected` (Request.is_disconnected), a client that
        leaves while it waits cancels the request too; then the result is None."""
        if disconnected is None:
            return [chunk async for chunk in self]
        chunks: list[T] = []
        async with anyio.create_task_group() as group:
            group.start_soon(self._cancel_when_gone, disconnected, group.cancel_scope)
            async for chunk in self:
                chunks.append(chunk)
            group.cancel_scope.cancel()
            return chunks
        return None  # cancelled because the client went away

    @staticmethod
    async def _cancel_when_gone(disconnected: Callable[[], Awaitable[bool]], scope: anyio.CancelScope) -> None:
        while not await disconnected():
            await anyio.sleep(0.25)
        scope.cancel()


# ---------------------------------------------------------------------------------------------------------- merging

def merge_generate(chunks: list[api.GenerateChunk]) -> api.GenerateChunk:
    """One non-streamed answer: all the text, with the final chunk's reason and timings."""
    last = chunks[-1]
    thinking = "".join(c.thinking or "" for c in chunks)
    return last.model_copy(update={"response": "".join(c.response for c in chunks), "thinking": thinking or None,
                                   **_joined_tokens(chunks)})


def merge_chat(chunks: list[api.ChatChunk]) -> api.ChatChunk:
    """One non-streamed chat answer: content and thinking joined, every tool call kept."""
    last = chunks[-1]
    content = "".join(c.message.content for c in chunks)
    thinking = "".join(c.message.thinking or "" for c in chunks)
    calls = [call for c in chunks for call in (c.message.tool_calls or [])]
    message = api.Message(role="assistant", content=content, thinking=thinking or None, tool_calls=calls or None)
    return last.model_copy(update={"message": message, **_joined_tokens(chunks)})


def _joined_tokens(chunks: list[Any]) -> dict[str, Any]:
    tokens = [t for c in chunks for t in (c.tokens or [])]
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    return {"tokens": tokens or None, "logprobs": logprobs or None}
