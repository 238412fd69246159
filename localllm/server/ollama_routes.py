"""Ollama's native API, field for field: each handler validates into an api type, calls the client, and renders.

Inference handlers pull the first chunk before answering (ChunkStream.open), so an unknown model is a 404, an
overflow a 400 and a full queue a 503 rather than an error inside a 200 stream."""

from __future__ import annotations

import tempfile
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from .. import api
from ..models.info import require_tools
from .chunk_stream import ChunkStream
from .ignored import with_repairs
from .offloop import json_body, until_gone
from .responses import client_gone, merge_chat, merge_generate, ndjson_response
from .state import State

router = APIRouter()


def json_of(value: BaseModel) -> JSONResponse:
    """Ollama omits empty fields; so do we."""
    return JSONResponse(value.model_dump(mode="json", exclude_none=True, by_alias=True))


def asks_unload(keep_alive: float | None) -> bool:
    """Ollama: a request with nothing to generate and keep_alive 0 unloads the model without loading it."""
    return keep_alive == 0


# ---------------------------------------------------------------------------------------------------------- models


@router.get("/api/version")
def version(state: State) -> JSONResponse:
    return json_of(api.VersionResponse(version=api.OLLAMA_API_VERSION, localllm=state.client.version()))


@router.get("/api/tags")
def tags(state: State) -> JSONResponse:
    return json_of(state.client.list_models())


@router.get("/api/ps")
def ps(state: State) -> JSONResponse:
    return json_of(state.client.ps())


@router.post("/api/plan")
def plan(body: api.PlanRequest, state: State) -> JSONResponse:
    """A localllm extension: `localllm plan` over the API (the web page shows it before a load)."""
    return json_of(state.client.plan(body))


@router.post("/api/show")
def show(body: api.ShowRequest, state: State) -> JSONResponse:
    return json_of(state.client.show(body.model, verbose=body.verbose))


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
    collected = await chunks.collect()
    return json_of(collected[-1]) if collected else client_gone()


@router.post("/api/pull")
async def pull(body: api.PullRequest, state: State) -> Response:
    return await progress_response(lambda: state.client.pull(body.model), body.stream)


@router.post("/api/create")
async def create(body: api.CreateRequest, state: State) -> Response:
    return await progress_response(lambda: state.client.create(body), body.stream)


@router.head("/api/blobs/{digest}")
def blob_exists(digest: str, state: State) -> Response:
    if not state.client.has_blob(digest):
        return JSONResponse({"error": f"blob {digest!r} not found"}, status_code=404)
    return Response(status_code=200)


@router.post("/api/blobs/{digest}")
async def upload_blob(digest: str, state: State, http: Request) -> Response:
    """Ollama's upload for create(files=...): 200 when the blob is already there, 201 once stored; bytes with
    another sha256 are a 400. The body is spooled to disk first: the store hashes and writes on a worker thread."""
    if await run_in_threadpool(state.client.has_blob, digest):
        return Response(status_code=200)
    with tempfile.TemporaryFile() as spool:
        async for block in http.stream():
            await run_in_threadpool(spool.write, block)
        spool.seek(0)
        await run_in_threadpool(state.client.add_blob, digest, spool)
    return Response(status_code=201)


# ---------------------------------------------------------------------------------------------------------- inference


async def check_tools(state: State, model: str, tools: bool) -> None:
    """Ollama's 400 for tools the model cannot be shown (its wording, which clients match on). Thinking a model
    cannot do is refused by the client, on every route (thinking.check_thinking)."""
    if tools:
        shown = await run_in_threadpool(state.client.show, model)
        require_tools(model, shown.capabilities)


@router.post("/api/generate")
async def generate(
    body: Annotated[api.GenerateRequest, json_body(api.GenerateRequest)], state: State, http: Request
) -> Response:
    body.options = api.request_options(body.options)
    if not body.prompt and not body.context and asks_unload(body.keep_alive):
        return await unload(body.model, state)
    chunks = await ChunkStream.open(
        lambda: state.client.generate(body), observe=state.metrics.observe_chunk, disconnected=http.is_disconnected
    )
    if body.stream:
        return ndjson_response(chunks)
    collected = await chunks.collect(disconnected=http.is_disconnected)
    return json_of(merge_generate(collected)) if collected else client_gone()


@router.post("/api/chat")
async def chat(body: Annotated[api.ChatRequest, json_body(api.ChatRequest)], state: State, http: Request) -> Response:
    body.options = api.request_options(body.options)
    if not body.messages and asks_unload(body.keep_alive):
        return await unload(body.model, state, chat=True)
    await check_tools(state, body.model, bool(body.tools))
    chunks = await ChunkStream.open(
        lambda: state.client.chat(body), observe=state.metrics.observe_chunk, disconnected=http.is_disconnected
    )
    if body.stream:
        return ndjson_response(chunks)
    collected = await chunks.collect(disconnected=http.is_disconnected)
    if not collected:
        return client_gone()
    merged = merge_chat(collected)
    return with_repairs(json_of(merged), [merged])


@router.post("/api/count_tokens")
def count_tokens(body: Annotated[api.ChatRequest, json_body(api.ChatRequest)], state: State) -> JSONResponse:
    """The prompt tokens a chat request would take (a localllm extension; HttpClient.count_tokens calls it)."""
    return JSONResponse({"input_tokens": state.client.count_tokens(body)})


async def unload(model: str, state: State, *, chat: bool = False) -> JSONResponse:
    await run_in_threadpool(state.client.stop, model)
    if chat:
        return json_of(api.ChatChunk(model=model, done=True, done_reason="unload"))
    return json_of(api.GenerateChunk(model=model, done=True, done_reason="unload"))


@router.post("/api/embed")
async def embed(
    body: Annotated[api.EmbedRequest, json_body(api.EmbedRequest)], state: State, http: Request
) -> Response:
    body.options = api.request_options(body.options)
    response = await until_gone(partial(state.client.embed, body), http.is_disconnected)
    state.metrics.observe_embed(response)
    return json_of(response)


class LegacyEmbeddingsRequest(BaseModel):
    """/api/embeddings, Ollama's older single-prompt form (server-only wire type)."""

    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: api.Duration | None = None


@router.post("/api/embeddings")
async def embeddings(body: LegacyEmbeddingsRequest, state: State, http: Request) -> JSONResponse:
    request = api.EmbedRequest(
        model=body.model, input=body.prompt, options=api.request_options(body.options), keep_alive=body.keep_alive
    )
    response = await until_gone(partial(state.client.embed, request), http.is_disconnected)
    state.metrics.observe_embed(response)
    return JSONResponse({"embedding": response.embeddings[0] if response.embeddings else []})
