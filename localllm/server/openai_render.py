"""Our api chunks rendered as OpenAI objects: chat completions, text completions, their SSE chunks, embeddings and
model lists. Pure functions and two small stateful stream renderers; no I/O."""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from .. import api
from .chunk_stream import ChunkStream
from .responses import error_payload

FINGERPRINT = "fp_localllm"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(done_reason: Optional[str], *, tool_calls: bool = False) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if done_reason == "length" else "stop"


def usage(chunk: api.Timings) -> dict[str, Any]:
    return {"prompt_tokens": chunk.prompt_eval_count, "completion_tokens": chunk.eval_count,
            "total_tokens": chunk.prompt_eval_count + chunk.eval_count,
            "prompt_tokens_details": {"cached_tokens": chunk.prompt_cache_count}}


def tool_calls(calls: list[api.ToolCall], *, indexed: bool = False) -> list[dict[str, Any]]:
    """OpenAI carries arguments as a JSON string; a streamed call also carries its index."""
    out = []
    for index, call in enumerate(calls):
        item = {"id": call.id or new_id("call"), "type": "function",
                "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)}}
        out.append({"index": index, **item} if indexed else item)
    return out


def chat_logprobs(logprobs: Optional[list[api.TokenLogprob]]) -> Optional[dict[str, Any]]:
    if not logprobs:
        return None
    return {"content": [lp.model_dump(include={"token", "logprob", "bytes", "top_logprobs"}) for lp in logprobs]}


@dataclass
class Envelope:
    """The fields every object of one response shares."""

    model: str
    prefix: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.prefix)

    def wrap(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT, "choices": choices, **extra}


# ---------------------------------------------------------------------------------------------------------- chat

def chat_completion(merged: api.ChatChunk, envelope: Envelope) -> dict[str, Any]:
    calls = merged.message.tool_calls or []
    message: dict[str, Any] = {"role": "assistant", "content": merged.message.content if not calls else None}
    if calls:
        message["tool_calls"] = tool_calls(calls)
    if merged.message.thinking:
        message["reasoning_content"] = merged.message.thinking
    choice = {"index": 0, "message": message, "logprobs": chat_logprobs(merged.logprobs),
              "finish_reason": finish_reason(merged.done_reason, tool_calls=bool(calls))}
    return envelope.wrap("chat.completion", [choice], usage=usage(merged))


@dataclass
class ChatEvents:
    """A chat stream as chat.completion.chunk objects: the role in the first delta, tool calls and finish_reason in
    the last, then a usage-only chunk when the client asked for it."""

    envelope: Envelope
    include_usage: bool = False
    started: bool = False

    def events(self, chunk: api.ChatChunk) -> list[dict[str, Any]]:
        out = []
        if chunk.message.thinking:  # DeepSeek's field for the thinking, which OpenAI clients read
            out.append(self._delta({"reasoning_content": chunk.message.thinking}, None, None))
        text = chunk.message.content
        if text or chunk.logprobs or not self.started:
            out.append(self._delta({"content": text}, None, chunk.logprobs))
        if chunk.done:
            calls = chunk.message.tool_calls or []
            delta = {"tool_calls": tool_calls(calls, indexed=True)} if calls else {}
            out.append(self._delta(delta, finish_reason(chunk.done_reason, tool_calls=bool(calls)), None))
            if self.include_usage:
                out.append(self.envelope.wrap("chat.completion.chunk", [], usage=usage(chunk)))
        return out

    def _delta(self, delta: dict[str, Any], finish: Optional[str], logprobs) -> dict[str, Any]:
        if not self.started:
            delta = {"role": "assistant", **delta}
            self.started = True
        choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
        extra = {"usage": None} if self.include_usage else {}
        return self.envelope.wrap("chat.completion.chunk", [choice], **extra)


# ---------------------------------------------------------------------------------------------------------- completions

@dataclass
class CompletionLogprobs:
    """The legacy completions logprobs layout; text offsets run across the whole answer."""

    offset: int = 0

    def render(self, logprobs: Optional[list[api.TokenLogprob]]) -> Optional[dict[str, Any]]:
        if not logprobs:
            return None
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
                "text_offset": offsets}


def text_completion(merged: api.GenerateChunk, envelope: Envelope) -> dict[str, Any]:
    choice = {"index": 0, "text": merged.response, "logprobs": CompletionLogprobs().render(merged.logprobs),
              "finish_reason": finish_reason(merged.done_reason)}
    return envelope.wrap("text_completion", [choice], usage=usage(merged))


@dataclass
class CompletionEvents:
    envelope: Envelope
    include_usage: bool = False
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)

    def events(self, chunk: api.GenerateChunk) -> list[dict[str, Any]]:
        finish = finish_reason(chunk.done_reason) if chunk.done else None
        choice = {"index": 0, "text": chunk.response, "logprobs": self.logprobs.render(chunk.logprobs),
                  "finish_reason": finish}
        out = [self.envelope.wrap("text_completion", [choice])]
        if chunk.done and self.include_usage:
            out.append(self.envelope.wrap("text_completion", [], usage=usage(chunk)))
        return out


# ---------------------------------------------------------------------------------------------------------- SSE

def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(stream: ChunkStream, renderer: ChatEvents | CompletionEvents) -> AsyncIterator[bytes]:
    """Server-sent events ending in `data: [DONE]`; an error after the first event is sent as an error event."""
    try:
        async for chunk in stream:
            for event in renderer.events(chunk):
                yield sse(event)
    except Exception as exc:  # noqa: BLE001 - the status line is gone; the error travels as an event
        yield sse({"error": {"message": error_payload(exc)["error"], "type": "server_error"}})
        return
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------- others

def embeddings(response: api.EmbedResponse, encoding: str) -> dict[str, Any]:
    def encode(vector: list[float]) -> Any:
        if encoding == "base64":  # what the openai package asks for by default: little-endian float32
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector

    data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(response.embeddings)]
    return {"object": "list", "data": data, "model": response.model,
            "usage": {"prompt_tokens": response.prompt_eval_count, "total_tokens": response.prompt_eval_count}}


def model_entry(summary: api.ModelSummary) -> dict[str, Any]:
    return {"id": summary.name, "object": "model", "created": int(summary.modified_at.timestamp()),
            "owned_by": "localllm"}


def model_list(models: api.ListResponse) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(m) for m in models.models]}
