"""Responses: the one place where errors become HTTP statuses, and the streaming response that closes its stream.

Every error body is `{"error": ...}`: a string under Ollama's routes, OpenAI's object under /v1, Anthropic's
`{"type": "error", "error": {...}}` under /v1/messages. Status codes come from the `status_code` of the errors.*
class; a QueueFull adds Retry-After, an Unauthorized adds WWW-Authenticate."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from .. import api
from ..api import Timings
from ..errors import (
    ContextOverflow,
    LocalLLMError,
    ModelNotFound,
    PayloadTooLarge,
    QueueFull,
    Unauthorized,
    WorkerLost,
)
from .chunk_stream import ChunkStream

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


# ---------------------------------------------------------------------------------------------------------- errors


def error_headers(exc: Exception) -> dict[str, str]:
    if isinstance(exc, (QueueFull, WorkerLost)):
        return {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, Unauthorized):
        return {"WWW-Authenticate": "Bearer"}
    return {}


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "server_overloaded",
}
# OpenAI's string `code`s: clients map errors by them (litellm's ContextWindowExceededError comes only from
# context_length_exceeded). The most specific class wins; otherwise the code follows the status.
_OPENAI_CODES: tuple[tuple[type[LocalLLMError], str], ...] = (
    (ContextOverflow, "context_length_exceeded"),
    (ModelNotFound, "model_not_found"),
    (QueueFull, "rate_limit_exceeded"),
    (Unauthorized, "invalid_api_key"),
    (PayloadTooLarge, "request_too_large"),
)
_OPENAI_STATUS_CODES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    413: "request_too_large",
    415: "unsupported_media_type",
    503: "server_overloaded",
}


def openai_code(exc: Exception | None, status: int) -> str:
    for kind, code in _OPENAI_CODES:
        if isinstance(exc, kind):
            return code
    return _OPENAI_STATUS_CODES.get(status, "server_error")


# Anthropic's error type for each status (its API reference, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(message: str, status: int, exc: BaseException | None = None) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": anthropic_wording(message, exc)}}


def anthropic_wording(message: str, exc: BaseException | None) -> str:
    """Anthropic's own words where its clients parse them: Claude Code compacts a conversation when told
    `prompt is too long: N tokens > M maximum`."""
    if isinstance(exc, ContextOverflow):
        return f"prompt is too long: {exc.prompt_tokens} tokens > {exc.num_ctx} maximum ({message})"
    return message


def error_json(
    message: str, status: int, path: str, headers: dict[str, str] | None = None, exc: Exception | None = None
) -> JSONResponse:
    """Ollama's `{"error": "..."}`; under /v1 OpenAI's `{"error": {"message", "type", "param", "code"}}`, which
    its client libraries read; under /v1/messages Anthropic's."""
    if _anthropic_path(path):
        body: dict[str, Any] = anthropic_error(message, status, exc)
    elif path.startswith("/v1/"):
        body = {
            "error": {
                "message": message,
                "type": _OPENAI_TYPES.get(status, "server_error"),
                "param": None,
                "code": openai_code(exc, status),
            }
        }
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(exc: Exception, path: str = "") -> JSONResponse:
    """The JSON error for any exception: errors.* by their status, anything else a logged 500."""
    if isinstance(exc, LocalLLMError):
        if exc.status_code == 500:  # a fault of ours, not of the input: worth a line in the log
            log.error("%s answered %d: %s", path or "request", exc.status_code, exc)
        return error_json(str(exc), exc.status_code, path, error_headers(exc), exc)
    log.error("unexpected error", exc_info=exc)
    return error_json(f"internal error: {exc}", 500, path)


def describe_validation(exc: RequestValidationError, *, anthropic: bool = False) -> str:
    """pydantic's first complaint as one line naming the field: `invalid field messages.0.role: Input should be
    ...`; on Anthropic's routes as Anthropic words it, `messages.0.role: Input should be ...` (clients match it)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = ".".join(loc) or "body"
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
    return f"{field}: {err.get('msg')}" if anthropic else f"invalid field {field}: {err.get('msg')}"


def _anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


async def _on_local_error(request: Request, exc: LocalLLMError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    path = request.url.path
    return error_json(describe_validation(exc, anthropic=_anthropic_path(path)), 400, path)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_json(str(exc.detail), exc.status_code, request.url.path, dict(exc.headers or {}))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(LocalLLMError, _on_local_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """What a stream sends when it fails after output has started (the status line is already gone)."""
    if not isinstance(exc, LocalLLMError):
        log.error("stream failed", exc_info=exc)
    elif exc.status_code == 500:
        log.error("stream failed: %s", exc)
    return {"error": str(exc) if isinstance(exc, LocalLLMError) else f"internal error: {exc}"}


# ---------------------------------------------------------------------------------------------------------- streams


def client_gone() -> Response:
    """What a handler returns when its client left before the answer was ready (nobody reads it; 499 is nginx's
    code for that, and it shows in the access log)."""
    return Response(status_code=499)


class StreamResponse(StreamingResponse):
    """A streaming response that always closes its ChunkStream, even when the body never started (client gone)."""

    def __init__(self, body: AsyncIterator[bytes], stream: ChunkStream, *, media_type: str):
        super().__init__(body, media_type=media_type)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()


# Ollama sends the timing fields only with the final chunk.
_TIMING_FIELDS = frozenset(Timings.model_fields)


def chunk_json(chunk: BaseModel) -> bytes:
    exclude = None if getattr(chunk, "done", True) else set(_TIMING_FIELDS)
    return chunk.model_dump_json(exclude_none=True, exclude=exclude).encode()


async def _ndjson_lines(stream: ChunkStream) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk_json(chunk) + b"\n"
    except Exception as exc:  # noqa: BLE001 - after the first byte an error can only travel as a final line
        yield json.dumps(error_payload(exc)).encode() + b"\n"


def ndjson_response(stream: ChunkStream) -> StreamResponse:
    """Ollama's streaming format: one JSON object per line, errors as a last {"error": ...} line."""
    return StreamResponse(_ndjson_lines(stream), stream, media_type=NDJSON)


def sse_response(stream: ChunkStream, render: Callable[[ChunkStream], AsyncIterator[bytes]]) -> StreamResponse:
    """OpenAI's streaming format; `render` turns the chunks into `data: ...` events."""
    return StreamResponse(render(stream), stream, media_type="text/event-stream")


# -------------------------------------------------------------------------------------------- non-streamed answers


def merge_generate(chunks: list[api.GenerateChunk]) -> api.GenerateChunk:
    """One non-streamed answer: all the text, with the final chunk's reason and timings."""
    last = chunks[-1]
    thinking = "".join(c.thinking or "" for c in chunks)
    return last.model_copy(
        update={"response": "".join(c.response for c in chunks), "thinking": thinking or None, **_joined_tokens(chunks)}
    )


def merge_chat(chunks: list[api.ChatChunk]) -> api.ChatChunk:
    """One non-streamed chat answer: content and thinking joined, every tool call kept."""
    last = chunks[-1]
    content = "".join(c.message.content for c in chunks)
    thinking = "".join(c.message.thinking or "" for c in chunks)
    calls = [call for c in chunks for call in (c.message.tool_calls or [])]
    deltas = [delta for c in chunks for delta in (c.tool_call_deltas or [])]
    message = api.Message(role="assistant", content=content, thinking=thinking or None, tool_calls=calls or None)
    return last.model_copy(update={"message": message, "tool_call_deltas": deltas or None, **_joined_tokens(chunks)})


def _joined_tokens(chunks: list[Any]) -> dict[str, Any]:
    tokens = [t for c in chunks for t in (c.tokens or [])]
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    return {"tokens": tokens or None, "logprobs": logprobs or None}
