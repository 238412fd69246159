"""Our chat chunks rendered as Anthropic Messages: the message object, and its stream of named server-sent events
(message_start, content blocks opened, filled by deltas and closed one at a time, message_delta, message_stop).

Usage splits the prompt as Anthropic does: `input_tokens` are the ones evaluated, `cache_read_input_tokens` the
ones our prefix cache reused. message_start goes out when the engine has taken the request, before the prefill, and
`ping` events keep a silent stream alive. Pure functions and one small stateful stream renderer; no I/O."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ... import api
from ...client.protocol import Admission
from ...errors import LocalLLMError, QueueFull
from ..chunk_stream import ChunkStream
from ..responses import anthropic_error, error_payload


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(chunk: api.ChatChunk) -> str:
    if chunk.message.tool_calls:
        return "tool_use"
    if chunk.done_reason == "length":
        return "max_tokens"
    return "stop_sequence" if chunk.stop_sequence else "end_turn"


def usage(chunk: api.Timings) -> dict[str, Any]:
    return {
        "input_tokens": chunk.prompt_eval_count - chunk.prompt_cache_count,
        "output_tokens": chunk.eval_count,
        "cache_read_input_tokens": chunk.prompt_cache_count,
        "cache_creation_input_tokens": 0,
    }


def admission_usage(admission: Admission) -> dict[str, Any]:
    """message_start's usage: the split known when the engine took the request (none of the prompt counted as
    cached while it waits for a slot; message_delta then has the whole usage)."""
    cached = admission.cached_tokens or 0
    return {
        "input_tokens": admission.prompt_tokens - cached,
        "output_tokens": 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def signature(thinking: str) -> str:
    """Anthropic signs thinking so it can be sent back unchanged; ours only marks it as ours."""
    return "localllm:" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def tool_use_block(call: api.ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_id(call), "name": call.function.name, "input": call.function.arguments}


def _tool_id(call: api.ToolCall) -> str:
    return tool_id(call.id)


def tool_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or uuid.uuid4().hex[:24]).removeprefix("call_")


def content_blocks(message: api.Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.thinking:
        blocks.append({"type": "thinking", "thinking": message.thinking, "signature": signature(message.thinking)})
    if message.content or not (blocks or message.tool_calls):
        blocks.append({"type": "text", "text": message.content})
    blocks.extend(tool_use_block(call) for call in message.tool_calls or [])
    return blocks


def message(merged: api.ChatChunk, model: str, message_id: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(merged.message),
        "stop_reason": stop_reason(merged),
        "stop_sequence": merged.stop_sequence,
        "usage": usage(merged),
    }


# ---------------------------------------------------------------------------------------------------------- stream


@dataclass
class MessageEvents:
    """A chat stream as Anthropic's events. Blocks open when their first text comes; the thinking block closes (with
    its signature) when the answer's text begins; each tool call is a tool_use block, opened when its name is known
    and filled by input_json_delta pieces as its arguments are generated."""

    model: str
    message_id: str = field(default_factory=lambda: new_id("msg"))
    _index: int = -1
    _open: str | None = None  # the kind of the block now open
    _thinking: list[str] = field(default_factory=list)
    _started: bool = False
    _streamed_calls: bool = False

    def opening(self, admission: Admission | None) -> list[tuple[str, dict[str, Any]]]:
        """message_start, once the engine has taken the request; without an admission the first chunk starts it."""
        return [] if admission is None else self._start(admission_usage(admission))

    def events(self, chunk: api.ChatChunk) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if not self._started:
            out += self._start(usage(chunk))
        if chunk.message.thinking:
            out += self._delta("thinking", {"type": "thinking_delta", "thinking": chunk.message.thinking})
            self._thinking.append(chunk.message.thinking)
        if chunk.message.content:
            out += self._delta("text", {"type": "text_delta", "text": chunk.message.content})
        for delta in chunk.tool_call_deltas or []:
            out += self._call_delta(delta)
        if chunk.done:
            out += self._finish(chunk)
        return out

    def _start(self, counts: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self._started = True
        start: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": counts,  # the same split as message_delta's: cache reads apart from input_tokens
        }
        return [("message_start", {"type": "message_start", "message": start}), ("ping", {"type": "ping"})]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = (
            self._open_block(
                kind, {"type": "thinking", "thinking": ""} if kind == "thinking" else {"type": "text", "text": ""}
            )
            if self._open != kind
            else []
        )
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})]

    def _call_delta(self, delta: api.ToolCallDelta) -> list[tuple[str, dict[str, Any]]]:
        if delta.id is not None:
            self._streamed_calls = True
            block = {"type": "tool_use", "id": tool_id(delta.id), "name": delta.name or "", "input": {}}
            return self._open_block("tool_use", block)
        if not delta.arguments:
            return []
        piece = {"type": "input_json_delta", "partial_json": delta.arguments}
        return [("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": piece})]

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = self._close_block()
        self._index += 1
        self._open = kind
        return out + [
            ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        ]

    def _close_block(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append(
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "signature_delta", "signature": signature("".join(self._thinking))},
                    },
                )
            )
        self._open = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _finish(self, chunk: api.ChatChunk) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if self._index < 0 and not chunk.message.tool_calls:
            out += self._open_block("text", {"type": "text", "text": ""})
        for call in chunk.message.tool_calls or [] if not self._streamed_calls else []:
            block = tool_use_block(call)
            out += self._open_block("tool_use", {**block, "input": {}})
            out.append(
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                    },
                )
            )
        out += self._close_block()
        reason = "tool_use" if self._streamed_calls and chunk.done_reason != "length" else stop_reason(chunk)
        delta = {"stop_reason": reason, "stop_sequence": chunk.stop_sequence}
        out.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(chunk)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out


def sse(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


PING = sse("ping", {"type": "ping"})


async def sse_events(stream: ChunkStream, renderer: MessageEvents) -> AsyncIterator[bytes]:
    """The event stream, pinged while silent; an error after the first event is Anthropic's `error` event."""

    def render(chunk: api.ChatChunk) -> bytes:
        return b"".join(sse(name, data) for name, data in renderer.events(chunk))

    try:
        for name, event in renderer.opening(stream.admission):
            yield sse(name, event)
        async for data in stream.paced(render, PING):
            yield data
    except Exception as exc:  # noqa: BLE001 - the status line is gone; the error travels as an event
        status = exc.status_code if isinstance(exc, LocalLLMError) else 500
        status = 503 if isinstance(exc, QueueFull) else status
        yield sse("error", anthropic_error(error_payload(exc)["error"], status, exc))
