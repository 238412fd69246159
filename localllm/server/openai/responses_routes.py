"""OpenAI's Responses API (what Codex speaks): POST /v1/responses, GET/DELETE /v1/responses/{id} for stored ones,
GET /v1/responses/{id}/input_items, and POST /v1/responses/compact (compaction.py).

A turn is translated into a chat request (responses_requests.py) after the stored conversation named by
`previous_response_id`, so the prompt repeats the earlier turns token for token and the prefix cache serves them.
A turn whose input ends with a `compaction_trigger` compacts instead of answering. Answers are stored
(response_store) unless the request says `store: false`."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ... import api
from ..chunk_stream import ChunkStream
from ..first_call import one_call_at_most
from ..ignored import with_notes, with_repairs
from ..offloop import json_body
from ..responses import StreamResponse, client_gone, merge_chat
from ..state import State
from . import compaction, response_store
from . import responses_render as render
from .responses_requests import (
    CompactRequest,
    ResponsesRequest,
    chat_request,
    compaction_triggered,
    conversation,
    ignored,
    input_item_records,
    turn_instructions,
)

router = APIRouter(prefix="/v1/responses")


async def stored_history(previous_response_id: str | None) -> list[api.Message]:
    if not previous_response_id:
        return []
    return (await run_in_threadpool(response_store.load, previous_response_id)).messages


@router.post("")
async def create_response(
    body: Annotated[ResponsesRequest, json_body(ResponsesRequest)], state: State, http: Request
) -> Response:
    history = await stored_history(body.previous_response_id)
    if compaction_triggered(body.input):
        return with_notes(await compaction_turn(body, history, state), ignored(body))
    request = await run_in_threadpool(chat_request, body, history)  # a long history: off the event loop
    request = request.model_copy(update={"parallel_tool_calls": body.parallel_tool_calls})
    chunks = await ChunkStream.open(
        lambda: one_call_at_most(state.client.chat(request), body.parallel_tool_calls),
        observe=state.metrics.observe_chunk,
        disconnected=http.is_disconnected,
    )
    frame = render.ResponseFrame(body)
    records = input_item_records(body.input)

    def keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if body.store:
            said = request.messages[len(turn_instructions(body)) :] + [render.answer_message(items)]
            response_store.save(api.StoredResponse(response=response, messages=said, input_items=records))

    if body.stream:
        events = render.ResponseEvents(frame)
        streamed = StreamResponse(render.sse_events(chunks, events, keep), chunks, media_type="text/event-stream")
        return with_notes(streamed, ignored(body))
    collected = await chunks.collect(disconnected=http.is_disconnected)
    if not collected:
        return client_gone()
    merged = merge_chat(collected)
    response = frame.completed(merged)
    await run_in_threadpool(keep, response, response["output"])
    return with_repairs(with_notes(JSONResponse(response), ignored(body)), [merged])


async def compaction_turn(body: ResponsesRequest, history: list[api.Message], state: State) -> Response:
    """A turn ending in compaction_trigger: its output is one compaction item; the stored conversation it leaves
    is the user messages and the summary, so previous_response_id continues from the compacted history."""
    said = conversation(body.input, history)
    compacted = await compaction.compact(state, body.model, turn_instructions(body), said)
    item = compaction.compaction_item(compacted.summary, render.new_id)
    frame = render.ResponseFrame(body)
    response = frame.response("completed", [item], compacted.final.model_copy(update={"done_reason": "stop"}))
    if body.store:
        kept = api.StoredResponse(
            response=response,
            messages=compacted.conversation(),
            input_items=input_item_records(body.input),
        )
        await run_in_threadpool(response_store.save, kept)
    if not body.stream:
        return JSONResponse(response)
    events = compaction.trigger_events(frame.response("in_progress", []), response, item)

    async def stream():
        for event in events:
            yield render.sse(event)

    return StreamingResponse(stream(), media_type="text/event-stream")


@router.post("/compact")
async def compact(body: CompactRequest, state: State) -> JSONResponse:
    """Codex's remote compaction: the user messages, then one compaction item in place of the rest."""
    said = conversation(body.input, await stored_history(body.previous_response_id))
    compacted = await compaction.compact(state, body.model, turn_instructions(body), said)
    item = compaction.compaction_item(compacted.summary, render.new_id)
    output = compaction.user_items(compacted.users, render.new_id) + [item]
    answer = compaction.compacted_response(output, render.usage(compacted.final), render.new_id)
    return with_notes(JSONResponse(answer), ignored(body))


@router.get("/{response_id}")
def get_response(response_id: str) -> JSONResponse:
    return JSONResponse(response_store.load(response_id).response)


@router.get("/{response_id}/input_items")
def list_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> JSONResponse:
    stored = response_store.load(response_id)
    return JSONResponse(response_store.input_items_page(stored, limit=limit, order=order, after=after))


@router.delete("/{response_id}")
def delete_response(response_id: str) -> JSONResponse:
    response_store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
