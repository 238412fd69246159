"""At most one tool call per answer, for a request that turned parallel tool calls off (OpenAI's
`parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use`): the model's first call is kept, as if it had
stopped there. A wrapper over the client's RequestStream that is one itself, so the server can still cancel a queued
request through it."""

from __future__ import annotations

from collections.abc import Callable

from .. import api
from ..client.protocol import Admission, RequestStream


class FirstCallOnly:
    def __init__(self, chunks: RequestStream[api.ChatChunk]):
        self._chunks = chunks

    def __iter__(self) -> FirstCallOnly:
        return self

    def __next__(self) -> api.ChatChunk:
        chunk = next(self._chunks)
        calls, deltas = chunk.message.tool_calls, chunk.tool_call_deltas
        if (calls is None or len(calls) < 2) and not any(d.index > 0 for d in deltas or []):
            return chunk
        message = chunk.message.model_copy(update={"tool_calls": calls[:1] if calls else calls})
        kept = [d for d in deltas or [] if d.index == 0] or None
        return chunk.model_copy(update={"message": message, "tool_call_deltas": kept})

    def cancel(self) -> None:
        self._chunks.cancel()

    def close(self) -> None:
        self._chunks.close()

    def on_admitted(self, hook: Callable[[Admission], None]) -> None:
        self._chunks.on_admitted(hook)


def one_call_at_most(chunks: RequestStream[api.ChatChunk], parallel: bool) -> RequestStream[api.ChatChunk]:
    return chunks if parallel else FirstCallOnly(chunks)
