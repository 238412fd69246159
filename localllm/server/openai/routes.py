"""OpenAI-compatible routes: translate the request (requests.py), call the same client as the Ollama routes,
render the answer (render.py). Streams are server-sent events ending in `data: [DONE]`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ...errors import ModelNotFound
from ..chunk_stream import ChunkStream
from ..ignored import with_repairs
from ..offloop import json_body, until_gone
from ..responses import client_gone, merge_chat, merge_generate, sse_response
from ..state import State
from . import render
from .requests import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_requests,
    completion_requests,
    embed_request,
)

router = APIRouter(prefix="/v1")


def _observe(state: State):
    """Metrics count each choice's final chunk."""
    return lambda item: state.metrics.observe_chunk(item[1])


def by_choice(items: list[tuple[int, Any]], merge: Callable[[list[Any]], Any]) -> list[Any]:
    """A batch's (index, chunk) items as one merged answer per choice, in index order."""
    chunks: dict[int, list[Any]] = {}
    for index, chunk in items:
        chunks.setdefault(index, []).append(chunk)
    return [merge(chunks[i]) for i in sorted(chunks)]


@router.post("/chat/completions")
async def chat_completions(
    body: Annotated[ChatCompletionRequest, json_body(ChatCompletionRequest)], state: State, http: Request
) -> Response:
    requests = await run_in_threadpool(chat_requests, body)  # thousands of messages: off the event loop
    chunks = await ChunkStream.open(
        lambda: state.client.chat_batch(requests), observe=_observe(state), disconnected=http.is_disconnected
    )
    envelope = render.Envelope(model=body.model, prefix="chatcmpl")
    if body.stream:
        events = render.ChatEvents(envelope, include_usage=body.include_usage, n=body.n)
        return sse_response(chunks, lambda s: render.sse_events(s, events))
    collected = await chunks.collect(disconnected=http.is_disconnected)
    if not collected:
        return client_gone()
    answers = by_choice(collected, merge_chat)
    return with_repairs(JSONResponse(render.chat_completion(answers, envelope)), answers)


@router.post("/completions")
async def completions(
    body: Annotated[CompletionRequest, json_body(CompletionRequest)], state: State, http: Request
) -> Response:
    requests, echoes = await run_in_threadpool(completion_requests, body)
    chunks = await ChunkStream.open(
        lambda: state.client.generate_batch(requests), observe=_observe(state), disconnected=http.is_disconnected
    )
    envelope = render.Envelope(model=body.model, prefix="cmpl")
    if body.stream:
        events = render.CompletionEvents(envelope, include_usage=body.include_usage, echoes=echoes, n=body.n)
        return sse_response(chunks, lambda s: render.sse_events(s, events))
    collected = await chunks.collect(disconnected=http.is_disconnected)
    if not collected:
        return client_gone()
    return JSONResponse(render.text_completion(by_choice(collected, merge_generate), envelope, echoes, body.n))


@router.post("/embeddings")
async def embeddings(
    body: Annotated[EmbeddingRequest, json_body(EmbeddingRequest)], state: State, http: Request
) -> JSONResponse:
    response = await until_gone(partial(state.client.embed, embed_request(body)), http.is_disconnected)
    state.metrics.observe_embed(response)
    return JSONResponse(render.embeddings(response, body.encoding_format))


@router.get("/models")
def models(state: State) -> JSONResponse:
    return JSONResponse(render.model_list(state.client.list_models()))


@router.get("/models/{model:path}")
def model(model: str, state: State) -> JSONResponse:
    for summary in state.client.list_models().models:
        if model in (summary.name, summary.model):
            return JSONResponse(render.model_entry(summary))
    raise ModelNotFound(f"model {model!r} not found", hint=f"pull it with `localllm pull {model}`")
