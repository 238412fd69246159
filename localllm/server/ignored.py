"""The X-LocalLLM-Ignored response header: the request fields an agent route accepted without effect, each with
why, so that nothing a client sends is dropped in silence (the agent APIs take many fields a local model has no use
for, and refusing them would stop the agents that always send them)."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from ..api import ChatChunk

R = TypeVar("R", bound=Response)

IGNORED_HEADER = "X-LocalLLM-Ignored"
REPAIRED_HEADER = "X-LocalLLM-Repaired"  # near tool calls made whole (chat/tool_calls.py), each with how
MAX_NOTES = 2000  # characters of the header; a body with hundreds of unknown fields is told about the first ones


class RequestBody(BaseModel):
    """An agent route's request body: fields we do not know are kept (model_extra), so they can be reported, not
    lost."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())


def with_notes(response: R, notes: list[str]) -> R:
    """The notes as one header line: ASCII (field names come from the client) and bounded."""
    if notes:
        text = "; ".join(notes).encode("ascii", "backslashreplace").decode("ascii")
        response.headers[IGNORED_HEADER] = text[:MAX_NOTES]
    return response


def with_repairs(response: R, answers: list[ChatChunk]) -> R:
    """The near tool calls the answers' parser repaired, as one header line, bounded as the notes are."""
    repairs = [repair for answer in answers for repair in answer.repairs or []]
    if repairs:
        text = "; ".join(repairs).encode("ascii", "backslashreplace").decode("ascii")
        response.headers[REPAIRED_HEADER] = text[:MAX_NOTES]
    return response
