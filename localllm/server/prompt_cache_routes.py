"""Prompt-cache files over REST (a localllm extension): the chat's `/save FILE.kv` and `/load FILE.kv` ask the server
for a conversation's cached state and hand one back, so a conversation and its cache can be kept in a file.

    POST /api/prompt-cache/save   a chat request (model, messages, options) -> the state's bytes
    POST /api/prompt-cache/load   ?request=<a chat request's JSON, for its model and options>, the bytes as the
                                  body -> {"tokens": N}, pinned in the prefix cache

The bytes carry the model digest and load fingerprint and a MAC made with this machine's key (localllm/signing.py):
a file for another model or load, one this server did not make, or one changed since, is a 400. A loaded state serves
only the conversation it holds until a request has continued from it (engine/prefix_cache.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from .. import api
from ..errors import InvalidInput
from .state import State

router = APIRouter()


@router.post("/api/prompt-cache/save")
async def save(body: api.ChatRequest, state: State) -> Response:
    data = await run_in_threadpool(state.client.save_prompt_cache, body)
    return Response(content=data, media_type="application/octet-stream")


@router.post("/api/prompt-cache/load")
async def load(request: str, state: State, http: Request) -> JSONResponse:
    try:
        which = api.ChatRequest.model_validate_json(request)
    except ValidationError as exc:
        raise InvalidInput(f"query parameter request is not a chat request: {exc.errors()[0]['msg']}") from None
    data = await http.body()  # bounded by LOCALLLM_MAX_BODY in the guard
    tokens = await run_in_threadpool(state.client.load_prompt_cache, which, data)
    return JSONResponse({"tokens": tokens})
