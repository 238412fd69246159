"""The bridge from the client's blocking chunk iterators to the event loop.

`Client.generate` / `Client.chat` return RequestStreams (client/protocol.py) that block while the engine works. Each
stream gets one pump thread (kept for a later stream once it ends) that runs its iterator and hands every chunk to the
event loop; a hop through a worker thread per chunk cost the loop about twice the CPU. `ChunkStream.open` waits for the
request's admission (the engine has taken it) or, for streams that have none, its first chunk: an error that comes
before (unknown model, bad options, context overflow, a template error, full queue) raises there and becomes a real HTTP
status, and a streamed response starts at once, not after a prefill that takes minutes on a CPU. `paced` then sends a
keep-alive whenever the stream has been silent for KEEP_ALIVE_SECONDS, since agents give up on a stream that says
nothing for long (a prefill, text the tool-call parser holds back). Closing the stream makes the pump close the client's
iterator at its next chunk, which cancels the request in the engine and frees its slot. A request still queued has no
next chunk to wait for, so closing also cancels the stream directly, and a client that leaves before its admission is
noticed while it waits. At most BUFFERED chunks wait for a slow reader; then the pump waits too (and so does the
request's output in the engine, bounded by its context).

Why a pump thread, not a callback from the engine thread: the client's iterator does the per-request work between the
engine and the wire (detokenized text, stop strings, tool-call parsing, thinking split), and that work must not run on
the engine thread, whose every microsecond between decodes is paid by all slots (docs/benchmark-notes.md)."""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
from anyio.lowlevel import RunVar

from ..client.protocol import Admission, RequestStream
from ..errors import Cancelled

if sys.version_info < (3, 11):  # anyio raises the backport's group there
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)

T = TypeVar("T")
_END = object()
_NONE = object()  # no chunk read ahead
BUFFERED = 256  # chunks a stream holds for a reader that falls behind
KEEP_ALIVE_SECONDS = 10.0  # the longest a paced stream stays silent (well under the agents' idle limits)

# A pump thread spends its life waiting for the engine's next chunk. The limiter bounds how many exist at once (one
# limiter per event loop, as anyio keeps its own); a stream beyond it waits for one to end.
_STREAM_THREADS: RunVar[anyio.CapacityLimiter] = RunVar("localllm_stream_threads")


class _PumpThreads:
    """Daemon threads that run pumps, each kept for the next stream once its own has ended: starting a thread is on
    every request's way to the engine (a third of a millisecond on a busy two-core machine), waking one is not. A
    thread idle for IDLE_SECONDS ends. Daemons, since a pump may wait on an engine when the server exits."""

    IDLE_SECONDS = 60.0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job, less the jobs already queued for them

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._work, args=(job,), name="localllm-stream", daemon=True).start()

    def _work(self, job: Callable[[], None] | None) -> None:
        while job is not None:
            job()
            with self._lock:
                self._idle += 1
            job = self._next_job()

    def _next_job(self) -> Callable[[], None] | None:
        while True:
            try:
                return self._jobs.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():  # no job was queued for this thread while it timed out: it leaves
                        self._idle -= 1
                        return None


_PUMPS = _PumpThreads()


def _stream_threads() -> anyio.CapacityLimiter:
    try:
        return _STREAM_THREADS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(512)
        _STREAM_THREADS.set(limiter)
        return limiter


class _Failed:
    """The iterator raised: the pump's last item, raised again on the event loop."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Admitted:
    """The engine has taken the request: the pump's first item, before any chunk."""

    def __init__(self, admission: Admission):
        self.admission = admission


def _pump(
    make: Callable[[], RequestStream[Any]],
    deliver: Callable[[Any], bool],
    stop: threading.Event,
    started: list[RequestStream[Any]],
) -> None:
    """The stream's thread: build the iterator, hand over each chunk, end with _END or _Failed. The iterator is
    closed here, before the last item, because a generator cannot be closed from another thread while it waits, and
    because its clean-up (the request's cancel, the model's release) must be over when the response ends."""

    def admitted(admission: Admission) -> None:
        deliver(_Admitted(admission))  # on a closed stream it goes nowhere, as a chunk would

    end: Any = _END
    iterator: RequestStream[Any] | None = None
    try:
        iterator = make()
        started.append(iterator)
        iterator.on_admitted(admitted)
        if stop.is_set():  # closed while the request was being made
            iterator.cancel()
        for chunk in iterator:
            if stop.is_set() or not deliver(chunk):
                break
    except BaseException as exc:
        end = _Failed(exc)
    finally:
        if iterator is not None:
            try:
                iterator.close()
            except Exception:  # noqa: BLE001 - nobody is left to tell but the log
                log.exception("closing a chunk stream failed")
        deliver(end)


class ChunkStream(Generic[T]):
    """A client's RequestStream driven from async code. Iterate it once; `aclose()` is idempotent and always safe."""

    def __init__(self, observe: Callable[[T], None] | None):
        self._chunks: asyncio.Queue = asyncio.Queue()
        self._room = threading.Semaphore(BUFFERED)  # taken by the pump per chunk, given back as the reader takes it
        self._stop = threading.Event()
        self._observe = observe
        self._first: Any = _NONE
        self._started: list[RequestStream[Any]] = []  # the client's stream, once the pump has made it
        self.admission: Admission | None = None  # what the engine said when it took the request; None: no engine

    @classmethod
    async def open(
        cls,
        make: Callable[[], RequestStream[T]],
        *,
        observe: Callable[[T], None] | None = None,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> ChunkStream[T]:
        """Start the request and wait for its admission (or, for a stream without one, its first chunk); errors
        before it raise here. With `disconnected` (Request.is_disconnected), a client that leaves while it waits
        (loading, templating) cancels the request and Cancelled is raised."""
        stream = cls(observe)
        limiter = _stream_threads()
        await limiter.acquire_on_behalf_of(stream)
        loop = asyncio.get_running_loop()

        def deliver(item: Any) -> bool:
            last = item is _END or isinstance(item, _Failed)
            if not last and not stream._wait_for_room():
                return False
            try:
                loop.call_soon_threadsafe(stream._chunks.put_nowait, item)
            except RuntimeError:  # the loop has closed (server shutdown): stop pumping
                return False
            if last:
                loop.call_soon_threadsafe(limiter.release_on_behalf_of, stream)
            return True

        _PUMPS.run(partial(_pump, make, deliver, stream._stop, stream._started))
        try:
            first = await stream._first_item(disconnected)
        except BaseException:
            await stream.aclose()
            raise
        if isinstance(first, _Admitted):
            stream.admission = first.admission
        else:
            stream._first = first
        return stream

    def _wait_for_room(self) -> bool:
        """On the pump thread: wait until the reader has taken enough chunks; False once the stream is closed."""
        while not self._room.acquire(timeout=0.5):
            if self._stop.is_set():
                return False
        return True

    async def _first_item(self, disconnected: Callable[[], Awaitable[bool]] | None) -> Any:
        if disconnected is None:
            return await self._next()
        first = asyncio.ensure_future(self._next())
        try:
            while not (await asyncio.wait({first}, timeout=0.25))[0]:
                if await disconnected():
                    raise Cancelled("the client went away before the answer started")
            return first.result()
        finally:
            first.cancel()

    async def _next(self) -> Any:
        """The pump's next item: a chunk, an _Admitted or _END; a failure raises."""
        item = await self._chunks.get()
        if isinstance(item, _Failed):
            raise item.exc
        if item is _END:
            return item
        self._room.release()
        if not isinstance(item, _Admitted) and self._observe is not None:
            self._observe(item)
        return item

    async def _take(self) -> Any:
        """The next chunk (first the one open() read, if it read one), or _END."""
        if self._first is not _NONE:
            chunk, self._first = self._first, _NONE
            return chunk
        item = await self._next()
        while isinstance(item, _Admitted):  # only the first item can be one: nothing new to say
            item = await self._next()
        return item

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            while (chunk := await self._take()) is not _END:
                yield chunk
        finally:
            await self.aclose()

    async def paced(self, render: Callable[[T], bytes], keep_alive: bytes) -> AsyncIterator[bytes]:
        """`render(chunk)` for each chunk (b"" sends nothing), and `keep_alive` whenever nothing has been sent for
        KEEP_ALIVE_SECONDS: while the prompt prefills, the request waits for a slot, or the tool-call parser holds
        text back, the client still sees a live stream."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                pending = pending or asyncio.ensure_future(self._take())
                quiet = max(0.0, sent + KEEP_ALIVE_SECONDS - loop.time())
                if not (await asyncio.wait({pending}, timeout=quiet))[0]:
                    yield keep_alive
                    sent = loop.time()
                    continue
                chunk, pending = pending.result(), None
                if chunk is _END:
                    return
                data = render(chunk)
                if data:
                    yield data
                    sent = loop.time()
        finally:
            if pending is not None:
                pending.cancel()
            await self.aclose()

    async def aclose(self) -> None:
        """Tell the pump to stop: it closes the stream when its next chunk comes (at the engine's next step); the
        stream is cancelled now too, so a queued request leaves the queue at once."""
        self._stop.set()
        for iterator in self._started:
            iterator.cancel()

    async def collect(self, *, disconnected: Callable[[], Awaitable[bool]] | None = None) -> list[T] | None:
        """All chunks, for a non-streamed answer. With `disconnected` (Request.is_disconnected), a client that
        leaves while it waits cancels the request too; then the result is None. An error from the stream is raised
        as itself (a task group would wrap it, and its status would be lost)."""
        if disconnected is None:
            return [chunk async for chunk in self]
        chunks: list[T] = []
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._cancel_when_gone, disconnected, group.cancel_scope)
                async for chunk in self:
                    chunks.append(chunk)
                group.cancel_scope.cancel()
                return chunks
        except BaseExceptionGroup as errors:
            raise _first_error(errors) from None
        return None  # cancelled because the client went away

    @staticmethod
    async def _cancel_when_gone(disconnected: Callable[[], Awaitable[bool]], scope: anyio.CancelScope) -> None:
        while not await disconnected():
            await anyio.sleep(0.25)
        scope.cancel()


def _first_error(errors: BaseExceptionGroup) -> BaseException:
    """The error inside a task group's (possibly nested) group: the stream's own error is its only one."""
    first: BaseException = errors
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first
