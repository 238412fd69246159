"""Anthropic's Messages API (what Claude Code speaks): translate the request (requests.py), call the same
client as the other routes, render the answer (render.py). Streams are named server-sent events.

`anthropic-version` and `anthropic-beta` headers are accepted and not needed; the key may come as `x-api-key` or a
bearer token (security.py); errors take Anthropic's shape (responses.py).

Thinking asked of a model that has none is answered without a thinking block, as llama-server does (Claude Code
sends `thinking` for the whole session, whatever the model): the X-LocalLLM-Ignored header says so, with every other
field accepted without effect. Ollama's routes keep the 400, which their clients use to adapt."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ... import api
from ..chunk_stream import ChunkStream
from ..first_call import one_call_at_most
from ..ignored import with_notes, with_repairs
from ..offloop import json_body
from ..responses import StreamResponse, client_gone, merge_chat
from ..state import State
from . import render
from .requests import CountTokensRequest, MessagesRequest, chat_request, ignored, parallel_tools

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/messages")


@router.post("")
async def messages(
    body: Annotated[MessagesRequest, json_body(MessagesRequest)], state: State, http: Request
) -> Response:
    request = await run_in_threadpool(chat_request, body)  # thousands of messages: off the event loop
    notes = ignored(body) + await thinking_notes(state, request)
    parallel = parallel_tools(body.tool_choice)
    request = request.model_copy(update={"parallel_tool_calls": parallel})  # the call grammar stops after one
    chunks = await ChunkStream.open(
        lambda: one_call_at_most(state.client.chat(request), parallel),
        observe=state.metrics.observe_chunk,
        disconnected=http.is_disconnected,
    )
    events = render.MessageEvents(model=body.model)
    if body.stream:
        response: Response = StreamResponse(render.sse_events(chunks, events), chunks, media_type="text/event-stream")
    else:
        collected = await chunks.collect(disconnected=http.is_disconnected)
        if not collected:
            return client_gone()
        merged = merge_chat(collected)
        response = with_repairs(JSONResponse(render.message(merged, body.model, events.message_id)), [merged])
    return with_notes(response, notes)


@router.post("/count_tokens")
async def count_tokens(
    body: Annotated[CountTokensRequest, json_body(CountTokensRequest)], state: State
) -> JSONResponse:
    request = await run_in_threadpool(chat_request, body)
    notes = ignored(body) + await thinking_notes(state, request)
    count = await run_in_threadpool(state.client.count_tokens, request)
    return with_notes(JSONResponse({"input_tokens": count}), notes)


async def thinking_notes(state: State, request: api.ChatRequest) -> list[str]:
    """Turn thinking off in `request` when its model cannot think (the note says so); nothing to say otherwise."""
    if not request.think:
        return []
    shown = await run_in_threadpool(state.client.show, request.model)
    if "thinking" in shown.capabilities:
        return []
    request.think = None
    log.info("%s cannot think: answering without a thinking block", request.model)
    return [f"thinking ({request.model} has no thinking capability; answered without a thinking block)"]
