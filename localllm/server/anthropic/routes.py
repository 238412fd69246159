"""Anthropic's Messages API (what Claude Code speaks): translate the request (requests.py), call the same
client as the other routes, render the answer (render.py). Streams are named server-sent events.

`anthropic-version` and `anthropic-beta` headers are accepted and not needed; the key may come as `x-api-key` or a
bearer token (security.py); errors take Anthropic's shape (responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..chunk_stream import ChunkStream
from ..responses import StreamResponse, client_gone, merge_chat
from ..state import State
from . import render
from .requests import CountTokensRequest, MessagesRequest, chat_request

router = APIRouter(prefix="/v1/messages")


@router.post("")
async def messages(body: MessagesRequest, state: State, http: Request) -> Response:
    request = chat_request(body)
    chunks = await ChunkStream.open(
        lambda: state.client.chat(request), observe=state.metrics.observe_chunk, disconnected=http.is_disconnected
    )
    events = render.MessageEvents(model=body.model)
    if body.stream:
        return StreamResponse(render.sse_events(chunks, events), chunks, media_type="text/event-stream")
    collected = await chunks.collect(disconnected=http.is_disconnected)
    if not collected:
        return client_gone()
    return JSONResponse(render.message(merge_chat(collected), body.model, events.message_id))


@router.post("/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State) -> JSONResponse:
    count = await run_in_threadpool(state.client.count_tokens, chat_request(body))
    return JSONResponse({"input_tokens": count})
