"""OpenAI-compatible routes: translate the request (openai_requests), call the same client as the Ollama routes,
render the answer (openai_render). Streams are server-sent events ending in `data: [DONE]`."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ..errors import ModelNotFound
from . import openai_render as render
from .chunk_stream import ChunkStream, merge_chat, merge_generate
from .openai_requests import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, chat_request,
                              completion_request, embed_request)
from .responses import client_gone, sse_response
from .state import State

router = APIRouter(prefix="/v1")


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, state: State, http: Request) -> Response:
    request = chat_request(body)
    chunks = await ChunkStream.open(lambda: state.client.chat(request), observe=state.metrics.observe_chunk,
                                    disconnected=http.is_disconnected)
    envelope = render.Envelope(model=body.model, prefix="chatcmpl")
    if body.stream:
        events = render.ChatEvents(envelope, include_usage=body.include_usage)
        return sse_response(chunks, lambda s: render.sse_events(s, events))
    collected = await chunks.collect(disconnected=http.is_disconnected)
    return JSONResponse(render.chat_completion(merge_chat(collected), envelope)) if collected else client_gone()


@router.post("/completions")
async def completions(body: CompletionRequest, state: State, http: Request) -> Response:
    request = completion_request(body)
    chunks = await ChunkStream.open(lambda: state.client.generate(request), observe=state.metrics.observe_chunk,
                                    disconnected=http.is_disconnected)
    envelope = render.Envelope(model=body.model, prefix="cmpl")
    if body.stream:
        events = render.CompletionEvents(envelope, include_usage=body.include_usage)
        return sse_response(chunks, lambda s: render.sse_events(s, events))
    collected = await chunks.collect(disconnected=http.is_disconnected)
    return JSONResponse(render.text_completion(merge_generate(collected), envelope)) if collected else client_gone()


@router.post("/embeddings")
def embeddings(body: EmbeddingRequest, state: State) -> JSONResponse:
    response = state.client.embed(embed_request(body))
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
