"""Codex's remote compaction: `POST /v1/responses/compact`, and a /v1/responses turn whose input ends with a
`compaction_trigger` item. The model writes a summary of the conversation (bounded in time, and in tokens by what it
replaces); the answer keeps the conversation's user messages and replaces everything else by one `compaction` item,
whose
`encrypted_content` is the summary sealed with this machine's key (signing.py). Sealed, not encrypted: the summary
never leaves the machine it was written on, but a client cannot forge or change it, so a later turn that sends the item
back gets exactly the summary in place of the history it replaced (responses_requests.py expands it)."""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from ... import api, signing
from ...errors import InvalidInput
from ..chunk_stream import ChunkStream
from ..responses import merge_chat
from ..state import State

PURPOSE = "responses-compaction"
TOKEN_PREFIX = "localllm-compaction-v1."
MAX_TOKEN_CHARS = 1 << 20  # a sealed summary far beyond any summary the token bound lets the model write

MIN_SUMMARY_TOKENS = 32
MAX_SUMMARY_TOKENS = 1024  # at most this much summary, and at most a quarter of the history it replaces
SUMMARY_SECONDS = 120.0  # the summary as written by then, if the model is still going

SUMMARY_PROMPT = (
    "Summarize the conversation above so that it can go on without it: the task, what has been done and found, "
    "decisions made, files, commands and values that matter, and what is left to do. Write only the summary."
)
SUMMARY_LEAD = "Summary of the conversation so far:\n"
RECENT_LEAD = "(no shorter summary could be written; the latest part of the conversation, word for word)\n"


# ---------------------------------------------------------------------------------------------------------- token


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def seal(summary: str) -> str:
    """The summary as an opaque token only this machine's key makes."""
    data = json.dumps({"summary": summary}, ensure_ascii=False).encode("utf-8")
    return TOKEN_PREFIX + _b64(data) + "." + _b64(signing.sign(PURPOSE, data))


def unseal(token: object, where: str) -> str:
    """The summary in a token from seal(); a 400 for anything else (forged, changed, from another machine)."""
    refused = InvalidInput(
        f"{where}.encrypted_content is not a compaction this server made, or it was changed",
        hint="send the compaction item back exactly as it came, or compact the conversation again",
    )
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or not token.startswith(TOKEN_PREFIX):
        raise refused
    body, _, mac = token.removeprefix(TOKEN_PREFIX).partition(".")
    try:
        data, tag = _unb64(body), _unb64(mac)
    except (binascii.Error, ValueError):
        raise refused from None
    if not signing.verify(PURPOSE, data, tag):
        raise refused
    summary = json.loads(data)["summary"]
    if not isinstance(summary, str):
        raise refused
    return summary


def summary_message(summary: str) -> api.Message:
    """What the model sees in place of the history a compaction replaced: its own summary."""
    return api.Message(role="assistant", content=SUMMARY_LEAD + summary)


# ---------------------------------------------------------------------------------------------------------- summary


def summary_request(model: str, instructions: list[api.Message], conversation: list[api.Message], budget: int):
    """The conversation as it stands (so the prefix cache serves it), then the request to summarize it."""
    messages = [*instructions, *conversation]
    if messages and messages[-1].role == "user":  # keep roles alternating for templates that insist on it
        last = messages[-1]
        messages[-1] = last.model_copy(update={"content": f"{last.content}\n\n{SUMMARY_PROMPT}"})
    else:
        messages.append(api.Message(role="user", content=SUMMARY_PROMPT))
    return api.ChatRequest(model=model, messages=messages, options={"num_predict": budget, "temperature": 0})


def summary_budget(replaced_tokens: int) -> int:
    """A summary is worth writing only when it is shorter than what it replaces."""
    return max(MIN_SUMMARY_TOKENS, min(MAX_SUMMARY_TOKENS, replaced_tokens // 4))


@dataclass(frozen=True)
class Compacted:
    """What a compaction leaves: the user messages it keeps word for word, the summary in place of the rest, and the
    summary pass's last chunk (its counts are the usage)."""

    users: list[api.Message]
    summary: str
    final: api.ChatChunk

    def conversation(self) -> list[api.Message]:
        """What a stored compacted turn continues from: the user messages, then the summary."""
        return [*self.users, summary_message(self.summary)]


Count = Callable[[list[api.Message]], Awaitable[int]]


async def compact(
    state: State, model: str, instructions: list[api.Message], conversation: list[api.Message]
) -> Compacted:
    """`conversation` compacted, always to fewer tokens than it had (counted with the model's template): the
    model's summary of all but the user messages, bounded by a quarter of what it replaces, or where the model
    cannot write one that short, the latest part of the conversation word for word (_recent)."""
    if not conversation:
        raise InvalidInput("there is no conversation to compact", hint="send input or a previous_response_id")

    async def count(messages: list[api.Message]) -> int:
        request = api.ChatRequest(model=model, messages=[*instructions, *messages])
        return await anyio.to_thread.run_sync(state.client.count_tokens, request) if request.messages else 0

    original = await count(conversation)
    users = [m for m in conversation if m.role == "user"]
    budget = summary_budget(original - await count(users))
    summary, final = await summarize(state, model, instructions, conversation, budget)
    compacted = Compacted(users, summary, final)
    if await count(compacted.conversation()) < original:
        return compacted
    return await _recent(count, original, conversation, compacted)


async def _recent(count: Count, original: int, conversation: list[api.Message], failed: Compacted) -> Compacted:
    """In place of a summary no shorter than the history: the latest part of what it would replace, word for word,
    halved until the compacted conversation is shorter than `original`; then the oldest user messages go too."""
    tail = transcript([m for m in conversation if m.role != "user"])
    users = list(failed.users)
    while True:
        compacted = Compacted(users, RECENT_LEAD + tail if tail else "", failed.final)
        if not (tail or users) or await count(compacted.conversation()) < original:
            return compacted
        if tail:
            tail = tail[len(tail) // 2 :].lstrip()
        else:
            users = users[1:]


def transcript(messages: list[api.Message]) -> str:
    """Messages as plain text, a paragraph each, tool calls as their names and arguments."""
    parts = []
    for message in messages:
        calls = [f"{c.function.name}({json.dumps(c.function.arguments)})" for c in message.tool_calls or []]
        text = " ".join([message.content, *calls]).strip()
        if text:
            parts.append(f"{message.role}: {text}")
    return "\n\n".join(parts)


async def summarize(
    state: State, model: str, instructions: list[api.Message], conversation: list[api.Message], budget: int
) -> tuple[str, api.ChatChunk]:
    """The model's summary of `conversation` in at most `budget` tokens, and the chunk whose counts are the pass's
    usage."""
    request = summary_request(model, instructions, conversation, budget)
    chunks = await ChunkStream.open(lambda: state.client.chat(request), observe=state.metrics.observe_chunk)
    collected: list[api.ChatChunk] = []
    with anyio.move_on_after(SUMMARY_SECONDS):
        async for chunk in chunks:
            collected.append(chunk)
    await chunks.aclose()
    merged = merge_chat(collected)
    if not merged.done:  # cut by the time bound: count what was written
        first = collected[0]
        merged = merged.model_copy(
            update={
                "prompt_eval_count": first.prompt_eval_count,
                "prompt_cache_count": first.prompt_cache_count,
                "eval_count": sum(len(c.tokens or []) for c in collected),
            }
        )
    return merged.message.content.strip() or "(the model wrote no summary)", merged


# ---------------------------------------------------------------------------------------------------------- items


def user_items(conversation: list[api.Message], new_id) -> list[dict]:
    """The conversation's user messages as input message items: a compaction keeps them word for word."""
    return [
        {
            "type": "message",
            "id": new_id("msg"),
            "status": "completed",
            "role": "user",
            "content": [{"type": "input_text", "text": m.content}],
        }
        for m in conversation
        if m.role == "user"
    ]


def compaction_item(summary: str, new_id) -> dict:
    return {"type": "compaction", "id": new_id("cmp"), "encrypted_content": seal(summary)}


def compacted_response(output: list[dict], usage: dict, new_id) -> dict:
    """POST /v1/responses/compact's answer (OpenAI's CompactedResponse)."""
    return {
        "id": new_id("resp"),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": output,
        "usage": usage,
    }


def trigger_events(in_progress: dict[str, Any], response: dict[str, Any], item: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed compaction turn, in OpenAI's order: the item is announced, then done, then the response."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": in_progress},
        {"type": "response.in_progress", "response": in_progress},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "encrypted_content": ""}},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": response},
    ]
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]
