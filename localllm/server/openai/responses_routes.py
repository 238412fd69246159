"""OpenAI's Responses API (what Codex speaks): POST /v1/responses, and GET/DELETE /v1/responses/{id} for stored ones.

A turn is translated into a chat request (responses_requests.py) after the stored conversation named by
`previous_response_id`, so the prompt repeats the earlier turns token for token and the prefix cache serves them.
Answers are stored (response_store) unless the request says `store: false`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ... import api
from ..chunk_stream import ChunkStream
from ..responses import StreamResponse, client_gone, merge_chat
from ..state import State
from . import response_store
from . import responses_render as render
from .responses_requests import ResponsesRequest, chat_request, turn_instructions

router = APIRouter(prefix="/v1/responses")


@router.post("")
async def create_response(body: ResponsesRequest, state: State, http: Request) -> Response:
    history = []
    if body.previous_response_id:
        history = (await run_in_threadpool(response_store.load, body.previous_response_id)).messages
    request = chat_request(body, history)
    chunks = await ChunkStream.open(
        lambda: state.client.chat(request), observe=state.metrics.observe_chunk, disconnected=http.is_disconnected
    )
    frame = render.ResponseFrame(body)

    def keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if body.store:
            conversation = request.messages[len(turn_instructions(body)) :] + [render.answer_message(items)]
            response_store.save(api.StoredResponse(response=response, messages=conversation))

    if body.stream:
        events = render.ResponseEvents(frame)
        return StreamResponse(render.sse_events(chunks, events, keep), chunks, media_type="text/event-stream")
    collected = await chunks.collect(disconnected=http.is_disconnected)
    if not collected:
        return client_gone()
    response = frame.completed(merge_chat(collected))
    await run_in_threadpool(keep, response, response["output"])
    return JSONResponse(response)


@router.get("/{response_id}")
def get_response(response_id: str) -> JSONResponse:
    return JSONResponse(response_store.load(response_id).response)


@router.delete("/{response_id}")
def delete_response(response_id: str) -> JSONResponse:
    response_store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
