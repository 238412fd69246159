"""Our chat chunks rendered as OpenAI Responses: the response object with its output items (reasoning, message,
function_call), and the stream of typed events in OpenAI's order:

    response.created, response.in_progress,
    per item: response.output_item.added, (response.content_part.added, *.delta..., *.done, response.content_part.done
              | response.function_call_arguments.delta, .done), response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens cut the answer).

Every event carries a sequence_number. response.created and response.in_progress go out when the engine has taken
the request, before the prefill; `: keep-alive` comments keep a silent stream alive. Pure functions and one stateful
stream renderer; no I/O."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ... import api
from ...client.protocol import Admission
from ..chunk_stream import ChunkStream
from ..responses import error_payload
from .responses_requests import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:32]}"


def usage(chunk: api.Timings) -> dict[str, Any]:
    return {
        "input_tokens": chunk.prompt_eval_count,
        "input_tokens_details": {"cached_tokens": chunk.prompt_cache_count},
        "output_tokens": chunk.eval_count,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chunk.prompt_eval_count + chunk.eval_count,
    }


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    content = [part] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(call: api.ToolCall, arguments: str | None = None, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call.id or new_id("call"),
        "name": call.function.name,
        "status": status,
        "arguments": json.dumps(call.function.arguments) if arguments is None else arguments,
    }


def output_items(message: api.Message) -> list[dict[str, Any]]:
    items = [reasoning_item(message.thinking)] if message.thinking else []
    if message.content or not (items or message.tool_calls):
        items.append(message_item(message.content))
    items.extend(function_call_item(call) for call in message.tool_calls or [])
    return items


def answer_message(items: list[dict[str, Any]]) -> api.Message:
    """The assistant turn the output items make, as the stored conversation keeps it."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    thinking = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
    calls = [
        api.ToolCall(
            id=i["call_id"], function=api.ToolCallFunction(name=i["name"], arguments=json.loads(i["arguments"]))
        )
        for i in items
        if i["type"] == "function_call" and i["status"] == "completed"
    ]
    return api.Message(role="assistant", content=text, thinking=thinking or None, tool_calls=calls or None)


@dataclass
class ResponseFrame:
    """What every rendering of one response shares: its id, its time, and the request fields it echoes."""

    body: ResponsesRequest
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], final: api.ChatChunk | None = None) -> dict:
        body = self.body
        incomplete = final is not None and final.done_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "model": body.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": {
                "effort": (body.reasoning or {}).get("effort"),
                "summary": (body.reasoning or {}).get("summary"),
            },
            "truncation": body.truncation or "disabled",
            "prompt_cache_key": body.prompt_cache_key,
            "metadata": body.metadata or {},
            "usage": usage(final) if final is not None else None,
        }

    def completed(self, merged: api.ChatChunk) -> dict[str, Any]:
        return self.response("completed", output_items(merged.message), merged)


# ---------------------------------------------------------------------------------------------------------- stream


@dataclass
class ResponseEvents:
    """A chat stream as Responses events. The reasoning item streams first, then the message; each tool call is a
    function_call item, added when its name is known and filled by argument deltas. `items` holds the finished
    output items, for the final response and the store."""

    frame: ResponseFrame
    items: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None
    _seq: int = 0
    _open: dict[str, Any] | None = None
    _text: list[str] = field(default_factory=list)
    _call: dict[str, Any] | None = None  # the function_call item now streaming
    _streamed_calls: bool = False

    def opening(self, admission: Admission | None) -> list[dict[str, Any]]:
        """response.created and .in_progress, once the engine has taken the request; without an admission the first
        chunk brings them."""
        return [] if admission is None else self._begin()

    def events(self, chunk: api.ChatChunk) -> list[dict[str, Any]]:
        out = self._begin()
        if chunk.message.thinking:
            out += self._delta("reasoning", chunk.message.thinking)
        if chunk.message.content:
            out += self._delta("message", chunk.message.content)
        for delta in chunk.tool_call_deltas or []:
            out += self._call_delta(delta)
        if chunk.done:
            out += self._finish(chunk)
        return out

    def _begin(self) -> list[dict[str, Any]]:
        if self._seq:
            return []
        in_progress = self.frame.response("in_progress", [])
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
        ]

    def _call_delta(self, delta: api.ToolCallDelta) -> list[dict[str, Any]]:
        if delta.id is not None:
            out = self._close_item() + self._close_call("completed")
            call = api.ToolCall(id=delta.id, function=api.ToolCallFunction(name=delta.name or ""))
            self._call, self._streamed_calls = function_call_item(call, "", "in_progress"), True
            return out + [self._event("response.output_item.added", output_index=len(self.items), item=self._call)]
        if self._call is None or not delta.arguments:
            return []
        self._call = {**self._call, "arguments": self._call["arguments"] + delta.arguments}
        where = {"item_id": self._call["id"], "output_index": len(self.items)}
        return [self._event("response.function_call_arguments.delta", **where, delta=delta.arguments)]

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        if self._call is None:
            return []
        item, self._call = {**self._call, "status": status}, None
        where = {"item_id": item["id"], "output_index": len(self.items)}
        self.items.append(item)
        return [
            self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = [] if self._open is not None and self._open["type"] == kind else self._open_item(kind)
        self._text.append(text)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        out = self._close_call("completed") + self._close_item()
        item = reasoning_item("") if kind == "reasoning" else message_item("", status="in_progress")
        item["content"] = []
        if kind == "reasoning":
            item["status"] = "in_progress"
        self._open, self._text = item, []
        part = (
            {"type": "reasoning_text", "text": ""}
            if kind == "reasoning"
            else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        )
        return out + [
            self._event("response.output_item.added", output_index=len(self.items), item=dict(item)),
            self._event("response.content_part.added", **self._where(), content_index=0, part=part),
        ]

    def _close_item(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        kind, text = self._open["type"], "".join(self._text)
        done = reasoning_item(text, self._open["id"]) if kind == "reasoning" else message_item(text, self._open["id"])
        part = done["content"][0]
        name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        out = [
            self._event(name, **self._where(), content_index=0, text=text),
            self._event("response.content_part.done", **self._where(), content_index=0, part=part),
            self._event("response.output_item.done", output_index=len(self.items), item=done),
        ]
        self.items.append(done)
        self._open = None
        return out

    def _finish(self, chunk: api.ChatChunk) -> list[dict[str, Any]]:
        out = []
        if not self.items and self._open is None and self._call is None and not chunk.message.tool_calls:
            out += self._open_item("message")
        out += self._close_item()
        out += self._close_call("incomplete" if chunk.done_reason == "length" else "completed")
        for call in chunk.message.tool_calls or [] if not self._streamed_calls else []:
            item = function_call_item(call)
            where = {"item_id": item["id"], "output_index": len(self.items)}
            out += [
                self._event(
                    "response.output_item.added",
                    output_index=len(self.items),
                    item={**item, "arguments": "", "status": "in_progress"},
                ),
                self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=len(self.items), item=item),
            ]
            self.items.append(item)
        self.final = self.frame.response("completed", self.items, chunk)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=self.final)]

    def error(self, exc: BaseException) -> dict[str, Any]:
        return self._event("error", code="server_error", message=error_payload(exc)["error"], param=None)


KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, idle timers see bytes


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(
    stream: ChunkStream, renderer: ResponseEvents, on_done: Callable[[dict[str, Any], list[dict[str, Any]]], None]
) -> AsyncIterator[bytes]:
    """The event stream, kept alive while silent; `on_done(response, items)` runs once the answer is whole (to
    store it)."""

    def render(chunk: api.ChatChunk) -> bytes:
        return b"".join(sse(event) for event in renderer.events(chunk))

    try:
        for event in renderer.opening(stream.admission):
            yield sse(event)
        async for data in stream.paced(render, KEEP_ALIVE):
            yield data
    except Exception as exc:  # noqa: BLE001 - the status line is gone; the error travels as an event
        yield sse(renderer.error(exc))
        return
    if renderer.final is not None:
        on_done(renderer.final, renderer.items)
