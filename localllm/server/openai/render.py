"""Our api chunks rendered as OpenAI objects: chat completions, text completions, their SSE chunks, embeddings and
model lists. A chat stream's first chunks (the role) go out when the engine has taken the request, before the
prefill, and `: keep-alive` comments keep a silent stream alive. Pure functions and two small stateful stream
renderers; no I/O."""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ... import api
from ...client.protocol import Admission
from ..chunk_stream import ChunkStream
from ..responses import error_payload, openai_code

FINGERPRINT = "fp_localllm"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(done_reason: str | None, *, tool_calls: bool = False) -> str:
    if done_reason == "length":  # a call cut off by max_tokens is a partial call, and says so
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(*chunks: api.Timings, per_prompt: int = 1) -> dict[str, Any]:
    """Usage of answers in index order, `per_prompt` of them to each prompt: OpenAI counts each prompt once (its
    first answer's figures) and every answer's tokens."""
    firsts = chunks[:: max(1, per_prompt)]
    prompt = sum(c.prompt_eval_count for c in firsts)
    completion = sum(c.eval_count for c in chunks)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.prompt_cache_count for c in firsts)},
    }


def tool_calls(calls: list[api.ToolCall]) -> list[dict[str, Any]]:
    """OpenAI carries arguments as a JSON string."""
    return [
        {
            "id": call.id or new_id("call"),
            "type": "function",
            "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)},
        }
        for call in calls
    ]


def stream_deltas(deltas: list[api.ToolCallDelta]) -> list[list[dict[str, Any]]]:
    """OpenAI's streamed tool call pieces, as the `tool_calls` of consecutive chunks: a call's first entry has id,
    type, name and empty arguments, the next ones its argument text. A chunk holds one entry per call, as OpenAI
    sends: clients' stream helpers take a second entry with the same index in one chunk for another call."""
    chunks: list[dict[int, dict[str, Any]]] = [{}]
    for delta in deltas:
        entry = chunks[-1].get(delta.index)
        if delta.id is not None or (entry is not None and "id" in entry):
            chunks.append({})  # a new call, or the first arguments of one just named: the next chunk
            entry = None
        if delta.id is not None:
            head = {"name": delta.name or "", "arguments": ""}
            chunks[-1][delta.index] = {"index": delta.index, "id": delta.id, "type": "function", "function": head}
            if delta.arguments:
                chunks.append({delta.index: {"index": delta.index, "function": {"arguments": delta.arguments}}})
        elif entry is None:
            chunks[-1][delta.index] = {"index": delta.index, "function": {"arguments": delta.arguments}}
        else:
            entry["function"]["arguments"] += delta.arguments
    return [[chunk[i] for i in sorted(chunk)] for chunk in chunks if chunk]


def whole_call_deltas(calls: list[api.ToolCall]) -> list[api.ToolCallDelta]:
    """Calls known only at the end, as the two deltas a streamed call starts with: id and name, then arguments."""
    out = []
    for index, call in enumerate(calls):
        out.append(api.ToolCallDelta(index=index, id=call.id or new_id("call"), name=call.function.name))
        out.append(api.ToolCallDelta(index=index, arguments=json.dumps(call.function.arguments)))
    return out


def chat_logprobs(logprobs: list[api.TokenLogprob] | None) -> dict[str, Any] | None:
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
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
            **extra,
        }


# ---------------------------------------------------------------------------------------------------------- chat


def chat_choice(index: int, merged: api.ChatChunk) -> dict[str, Any]:
    calls = tool_calls(merged.message.tool_calls or [])  # a call cut off by max_tokens is none: it says `length`
    message: dict[str, Any] = {"role": "assistant", "content": merged.message.content if not calls else None}
    if calls:
        message["tool_calls"] = calls
    if merged.message.thinking:
        message["reasoning_content"] = merged.message.thinking
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(merged.logprobs),
        "finish_reason": finish_reason(merged.done_reason, tool_calls=bool(calls)),
    }


def chat_completion(answers: list[api.ChatChunk], envelope: Envelope) -> dict[str, Any]:
    """The merged answers (one per choice, in index order) as one chat.completion."""
    choices = [chat_choice(index, merged) for index, merged in enumerate(answers)]
    return envelope.wrap("chat.completion", choices, usage=usage(*answers, per_prompt=len(answers)))


@dataclass
class ChatEvents:
    """A chat stream as chat.completion.chunk objects: for each choice a first chunk with the role alone, then its
    text or tool call pieces, then its finish_reason; a usage-only chunk ends the stream when the client asked."""

    envelope: Envelope
    include_usage: bool = False
    n: int = 1  # choices
    started: set[int] = field(default_factory=set)
    streamed_calls: set[int] = field(default_factory=set)
    finals: list[api.ChatChunk] = field(default_factory=list)

    def opening(self, admission: Admission | None) -> list[dict[str, Any]]:
        """Each choice's role chunk, once the engine has taken the request; without an admission each choice's
        first chunk brings its own."""
        return [] if admission is None else [event for index in range(self.n) for event in self._begin(index)]

    def events(self, item: tuple[int, api.ChatChunk]) -> list[dict[str, Any]]:
        index, chunk = item
        out = self._begin(index)
        if chunk.message.thinking:  # DeepSeek's field for the thinking, which OpenAI clients read
            out.append(self._delta(index, {"reasoning_content": chunk.message.thinking}))
        if chunk.message.content or chunk.logprobs:
            out.append(self._delta(index, {"content": chunk.message.content}, logprobs=chunk.logprobs))
        deltas = list(chunk.tool_call_deltas or [])
        if deltas:
            self.streamed_calls.add(index)
        elif chunk.done and chunk.message.tool_calls and index not in self.streamed_calls:
            deltas = whole_call_deltas(chunk.message.tool_calls)
        out += [self._delta(index, {"tool_calls": entries}) for entries in stream_deltas(deltas)]
        if chunk.done:
            self.finals.append(chunk)
            calls = bool(chunk.message.tool_calls) or index in self.streamed_calls
            out.append(self._delta(index, {}, finish=finish_reason(chunk.done_reason, tool_calls=calls)))
        return out

    def closing(self) -> list[dict[str, Any]]:
        if not self.include_usage or not self.finals:
            return []
        return [self.envelope.wrap("chat.completion.chunk", [], usage=usage(*self.finals, per_prompt=len(self.finals)))]

    def _begin(self, index: int) -> list[dict[str, Any]]:
        if index in self.started:
            return []
        self.started.add(index)
        return [self._delta(index, {"role": "assistant", "content": ""})]

    def _delta(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        finish: str | None = None,
        logprobs: list[api.TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
        extra = {"usage": None} if self.include_usage else {}
        return self.envelope.wrap("chat.completion.chunk", [choice], **extra)


# ---------------------------------------------------------------------------------------------------------- completions


@dataclass
class CompletionLogprobs:
    """The legacy completions logprobs layout; text offsets run across the whole answer."""

    offset: int = 0

    def render(self, logprobs: list[api.TokenLogprob] | None) -> dict[str, Any] | None:
        if not logprobs:
            return None
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {
            "tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
            "text_offset": offsets,
        }


def text_completion(
    answers: list[api.GenerateChunk], envelope: Envelope, echoes: list[str] | None = None, n: int = 1
) -> dict[str, Any]:
    """The merged answers (one per choice, `n` per prompt) as one text_completion; `echoes[i]` is prepended to
    choice i (`echo`)."""
    choices = []
    for index, merged in enumerate(answers):
        echo = echoes[index] if echoes else ""
        choices.append(
            {
                "index": index,
                "text": echo + merged.response,
                "logprobs": CompletionLogprobs(len(echo)).render(merged.logprobs),
                "finish_reason": finish_reason(merged.done_reason),
            }
        )
    return envelope.wrap("text_completion", choices, usage=usage(*answers, per_prompt=n))


@dataclass
class CompletionEvents:
    envelope: Envelope
    include_usage: bool = False
    echoes: list[str] | None = None
    n: int = 1
    logprobs: dict[int, CompletionLogprobs] = field(default_factory=dict)
    finals: list[api.GenerateChunk] = field(default_factory=list)

    def opening(self, admission: Admission | None) -> list[dict[str, Any]]:
        return []  # a text completion has no role chunk: its first text is its first event

    def events(self, item: tuple[int, api.GenerateChunk]) -> list[dict[str, Any]]:
        index, chunk = item
        text = chunk.response
        if index not in self.logprobs:  # the choice's first chunk: the echoed prompt goes first
            echo = self.echoes[index] if self.echoes else ""
            self.logprobs[index] = CompletionLogprobs(len(echo))
            text = echo + text
        finish = finish_reason(chunk.done_reason) if chunk.done else None
        if chunk.done:
            self.finals.append(chunk)
        choice = {
            "index": index,
            "text": text,
            "logprobs": self.logprobs[index].render(chunk.logprobs),
            "finish_reason": finish,
        }
        return [self.envelope.wrap("text_completion", [choice])]

    def closing(self) -> list[dict[str, Any]]:
        if not self.include_usage or not self.finals:
            return []
        return [self.envelope.wrap("text_completion", [], usage=usage(*self.finals, per_prompt=self.n))]


# ---------------------------------------------------------------------------------------------------------- SSE


KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies and idle timers see bytes


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(stream: ChunkStream, renderer: ChatEvents | CompletionEvents) -> AsyncIterator[bytes]:
    """Server-sent events ending in `data: [DONE]`, kept alive while silent; an error after the first event is sent
    as an error event."""

    def render(item: Any) -> bytes:
        return b"".join(sse(event) for event in renderer.events(item))

    try:
        for event in renderer.opening(stream.admission):
            yield sse(event)
        async for data in stream.paced(render, KEEP_ALIVE):
            yield data
        for event in renderer.closing():
            yield sse(event)
    except Exception as exc:  # noqa: BLE001 - the status line is gone; the error travels as an event
        status = getattr(exc, "status_code", 500)
        yield sse(
            {
                "error": {
                    "message": error_payload(exc)["error"],
                    "type": "server_error",
                    "code": openai_code(exc if isinstance(exc, Exception) else None, status),
                }
            }
        )
        return
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------- others


def embeddings(response: api.EmbedResponse, encoding: str) -> dict[str, Any]:
    def encode(vector: list[float]) -> Any:
        if encoding == "base64":  # what the openai package asks for by default: little-endian float32
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector

    data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(response.embeddings)]
    return {
        "object": "list",
        "data": data,
        "model": response.model,
        "usage": {"prompt_tokens": response.prompt_eval_count, "total_tokens": response.prompt_eval_count},
    }


def model_entry(summary: api.ModelSummary) -> dict[str, Any]:
    return {
        "id": summary.name,
        "object": "model",
        "created": int(summary.modified_at.timestamp()),
        "owned_by": "localllm",
    }


def model_list(models: api.ListResponse) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(m) for m in models.models]}
