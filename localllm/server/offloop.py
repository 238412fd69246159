"""Work a route hands to a worker thread, so that the event loop, which serves every other request (/health among
them), is never held by one: parsing and validating a large body, and blocking work that stops when its client leaves.

FastAPI parses and validates a declared body on the event loop; a body of many thousands of messages would stall
every other request meanwhile. Routes that take large bodies declare them as `Annotated[Model, json_body(Model)]`:
the bytes are read on the loop, parsed and validated on a worker thread (on the loop when small), and a bad body is
the same 400 as before."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

POLL_SECONDS = 0.25  # how often a running piece of work asks whether its client is still there
# A body up to this size is parsed on the loop: that takes less than the hop to a worker thread and back, which every
# request's first token would wait for.
INLINE_BODY_BYTES = 64 * 1024


def json_body(model: type[M]) -> Any:
    """A dependency that yields the request's JSON body as `model`, validated off the event loop."""

    async def parse(http: Request) -> M:
        raw = await http.body()
        try:
            if len(raw) <= INLINE_BODY_BYTES:
                return model.model_validate_json(raw or b"null")
            return await run_in_threadpool(model.model_validate_json, raw)
        except ValidationError as exc:
            # As FastAPI reports a body's errors, so the handlers word them the same way.
            errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None

    return Depends(parse)


async def until_gone(work: Callable[[Callable[[], bool]], T], disconnected: Callable[[], Awaitable[bool]]) -> T:
    """`work(cancelled)` on a worker thread; `cancelled()` turns true once the client has left, so work that asks
    between its pieces (an embedding request between batches) stops there."""
    gone = threading.Event()

    async def watch() -> None:
        while not await disconnected():
            await asyncio.sleep(POLL_SECONDS)
        gone.set()

    watcher = asyncio.ensure_future(watch())
    try:
        return await run_in_threadpool(work, gone.is_set)
    finally:
        watcher.cancel()
