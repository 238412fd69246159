"""Ollama's native API, field for field: each handler validates into an api type, calls the client, and renders.

Inference handlers pull the first chunk before answering (ChunkStream.open), so an unknown model is a 404, an
overflow a 400 and a full queue a 503 rather than an error inside a 200 stream."""

from __future__ import annotations

from typing import Any, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from .. import api, config
from .chunk_stream import ChunkStream, merge_chat, merge_generate
from .responses import client_gone, ndjson_response
from .state import State

router = APIRouter()


def json_of(value: BaseModel) -> JSONResponse:
    """Ollama omits empty fields; so do we."""
    return JSONResponse(value.model_dump(mode="json", exclude_none=True, by_alias=True))


def asks_unload(keep_alive: Any) -> bool:
    """Ollama: a request with nothing to generate and keep_alive 0 unloads the model without loading it."""
    if keep_alive is None:
        return False
    try:
        return config.parse_duration(keep_alive) == 0
    except ValueError:
        return False  # the client reports the bad value with its field name


# ---------------------------------------------------------------------------------------------------------- models

@router.get("/api/version")
def version(state: State) -> JSONResponse:
    return json_of(api.VersionResponse(version=state.client.version()))


@router.get("/api/tags")
def tags(state: State) -> JSONResponse:
    return json_of(state.client.list_models())


@router.get("/api/ps")
def ps(state: State) -> JSONResponse:
    return json_of(state.client.ps())


@router.post("/api/show")
def show(body: api.ShowRequest, state: State) -> JSONResponse:
    return json_of(state.client.show(body.model))


@router.post("/api/copy")
def copy(body: api.CopyRequest, state: State) -> Response:
    state.client.copy(body.source, body.destination)
    return Response(status_code=200)


@router.delete("/api/delete")
def delete(body: api.DeleteRequest, state: State) -> Response:
    state.client.delete(body.model)
    return Response(status_code=200)


async def progress_response(make: Any, stream: bool) -> Response:
    """Pull and create: NDJSON progress lines ending in {"status": "success"}, or only the last one."""
    chunks: ChunkStream[api.PullProgress] = await ChunkStream.open(make)
    if stream:
        return ndjson_response(chunks)
    return json_of((await chunks.collect())[-1])


@router.post("/api/pull")
async def pull(body: api.PullRequest, state: State) -> Response:
    return await progress_response(lambda: state.client.pull(body.model), body.stream)


@router.post("/api/create")
async def create(body: api.CreateRequest, state: State) -> Response:
    return await progress_response(lambda: state.client.create(body), body.stream)


# ---------------------------------------------------------------------------------------------------------- inference

@router.post("/api/generate")
async def generate(body: api.GenerateRequest, state: State, http: Request) -> Response:
    if not body.prompt and not body.context and asks_unload(body.keep_alive):
        return await unload(body.model, state)
    chunks = await ChunkStream.open(lambda: state.client.generate(body), observe=state.metrics.observe_chunk,
                                    disconnected=http.is_disconnected)
    if body.stream:
        return ndjson_response(chunks)
    collected = await chunks.collect(disconnected=http.is_disconnected)
    return json_of(merge_generate(collected)) if collected else client_gone()


@router.post("/api/chat")
async def chat(body: api.ChatRequest, state: State, http: Request) -> Response:
    if not body.messages and asks_unload(body.keep_alive):
        return await unload(body.model, state, chat=True)
    chunks = await ChunkStream.open(lambda: state.client.chat(body), observe=state.metrics.observe_chunk,
                                    disconnected=http.is_disconnected)
    if body.stream:
        return ndjson_response(chunks)
    collected = await chunks.collect(disconnected=http.is_disconnected)
    return json_of(merge_chat(collected)) if collected else client_gone()


async def unload(model: str, state: State, *, chat: bool = False) -> JSONResponse:
    await run_in_threadpool(state.client.stop, model)
    if chat:
        return json_of(api.ChatChunk(model=model, done=True, done_reason="unload"))
    return json_of(api.GenerateChunk(model=model, done=True, done_reason="unload"))


@router.post("/api/embed")
def embed(body: api.EmbedRequest, state: State) -> JSONResponse:
    response = state.client.embed(body)
    state.metrics.observe_embed(response)
    return json_of(response)


class LegacyEmbeddingsRequest(BaseModel):
    """/api/embeddings, Ollama's older single-prompt form (server-only wire type)."""

    model: str
    prompt: str
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: Union[str, int, float, None] = None


@router.post("/api/embeddings")
def embeddings(body: LegacyEmbeddingsRequest, state: State) -> JSONResponse:
    request = api.EmbedRequest(model=body.model, input=body.prompt, options=body.options, keep_alive=body.keep_alive)
    response = state.client.embed(request)
    state.metrics.observe_embed(response)
    return JSONResponse({"embedding": response.embeddings[0]})
