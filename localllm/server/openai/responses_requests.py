"""OpenAI's Responses request body (what Codex speaks) and its translation into our api.ChatRequest.

`input` is a string or a list of items: messages (with input_text / output_text parts, and input_image parts whose
image_url is a data: URI: they go before the message's text), `function_call` and
`function_call_output`, `reasoning` (its text becomes the next assistant turn's thinking), `compaction` (the sealed
summary a compaction wrote, in place of the history it replaced: compaction.py), and a last `compaction_trigger`
(this turn compacts instead of answering). `instructions` is the system prompt of this turn only;
`previous_response_id` puts the stored conversation before the new input. Tools other than functions (web search, a
local shell, custom grammar tools) cannot run here: they are left out with a warning in the log, so an agent that
always sends them still works. Fields accepted without effect are named by `ignored()` (the X-LocalLLM-Ignored
header); the rest are honoured or refused with a 400."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ... import api
from ...chat.thinking import think_from_effort
from ...errors import InvalidInput
from ...media import data_uri_image
from ..billing_header import strip_billing_header, without_billing_header
from ..ignored import RequestBody
from .compaction import summary_message, unseal

log = logging.getLogger(__name__)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class ResponseTool(_Wire):
    type: str = "function"
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(RequestBody):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=api.MAX_MESSAGES)] = Field(min_length=1)
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = Field(True, description="false: at most one function call per answer")
    prompt_cache_key: str | None = Field(
        None, max_length=1024, description="echoed; our prefix cache matches any earlier prompt without a key"
    )
    include: list[str] | None = Field(None, max_length=32)
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto drops the oldest prompt tokens on overflow (reported), disabled answers 400"
    )
    keep_alive: api.Duration | None = Field(None, description="Ollama's keep_alive (extension)")


class CompactRequest(RequestBody):
    """POST /v1/responses/compact: the conversation to compact (input, and/or a stored one)."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)


# What `include` can ask for. Reasoning comes back whole in each reasoning item's content, so a stateless client
# (store: false) has it without an encrypted copy; the tool outputs belong to tools that never run here.
INCLUDE_ACCEPTED = {
    "reasoning.encrypted_content": "reasoning items carry their text in content",
    "web_search_call.action.sources": "no web search runs here",
    "web_search_call.results": "no web search runs here",
    "file_search_call.results": "no file search runs here",
    "code_interpreter_call.outputs": "no code interpreter runs here",
    "computer_call_output.output.image_url": "no computer use runs here",
}
REASONING_SUMMARIES = ("auto", "concise", "detailed")


# ---------------------------------------------------------------------------------------------------------- request


def chat_request(body: ResponsesRequest, history: list[api.Message]) -> api.ChatRequest:
    """The chat request for one turn: this turn's instructions, the stored conversation (`history`), its input."""
    check_include(body.include)
    check_reasoning_summary(body.reasoning)
    messages = turn_instructions(body) + conversation(body.input, history)
    options = {"num_predict": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p}
    tools = [_tool(t) for t in body.tools or [] if _is_function(t)] or None
    return api.ChatRequest(
        model=body.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice(body.tool_choice),
        format=text_format(body.text),
        think=think_from_effort((body.reasoning or {}).get("effort"), field_name="reasoning.effort"),
        options={name: value for name, value in options.items() if value is not None},
        keep_alive=body.keep_alive,
        truncate=body.truncation == "auto",
    )


def conversation(items: str | list[dict[str, Any]] | None, history: list[api.Message]) -> list[api.Message]:
    """The stored conversation, then this input (less a final compaction_trigger), as messages."""
    calls = {call.id: call.function.name for m in history for call in m.tool_calls or [] if call.id}
    return list(history) + without_billing_header(input_messages(without_trigger(items), calls))


def compaction_triggered(items: str | list[dict[str, Any]] | None) -> bool:
    return isinstance(items, list) and bool(items) and items[-1].get("type") == "compaction_trigger"


def without_trigger(items: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]]:
    if items is None:
        return []
    return items[:-1] if compaction_triggered(items) else items


def check_include(include: list[str] | None) -> None:
    for value in include or []:
        if value not in INCLUDE_ACCEPTED:
            raise InvalidInput(
                f"include {value!r} is not supported",
                hint=f"use {', '.join(sorted(INCLUDE_ACCEPTED))}; for token logprobs use /v1/chat/completions",
            )


def check_reasoning_summary(reasoning: dict[str, Any] | None) -> None:
    summary = (reasoning or {}).get("summary")
    if summary is not None and summary not in REASONING_SUMMARIES:
        raise InvalidInput(f"reasoning.summary {summary!r} is not valid", hint="use auto, concise or detailed")


def ignored(body: ResponsesRequest | CompactRequest) -> list[str]:
    """The fields of `body` accepted without effect, each with why: reported to the client, never dropped silently."""
    notes = [f"{name} (not part of the Responses API here)" for name in sorted(body.model_extra or {})]
    if isinstance(body, ResponsesRequest):
        notes += [f"include {value} ({INCLUDE_ACCEPTED[value]})" for value in body.include or []]
        if (body.reasoning or {}).get("summary"):
            notes.append("reasoning.summary (no summary is written: the reasoning comes whole, in content)")
    return notes


def turn_instructions(body: ResponsesRequest | CompactRequest) -> list[api.Message]:
    """`instructions` as the system message of this turn only: OpenAI does not carry them to the next turn, so the
    stored conversation leaves them out."""
    text = strip_billing_header(body.instructions or "")
    return [api.Message(role="system", content=text)] if text else []


def tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """{"type": "function", "name": X} (Responses) as {"type": "function", "function": {"name": X}} (chat)."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not choice.get("name"):
        raise InvalidInput(
            f"tool_choice {json.dumps(choice)[:120]} is not valid",
            hint='use "auto", "none", "required" or {"type": "function", "name": ...}',
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def text_format(text: dict[str, Any] | None) -> api.Format:
    """text.format: {"type": "json_schema", "schema": ...} → the schema; json_object → "json"; text → none."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise InvalidInput('text.format must be an object such as {"type": "json_schema", "schema": {...}}')
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidInput("text.format.schema must be a JSON schema object")
        return fmt["schema"]
    raise InvalidInput(f"text.format.type {kind!r} is not valid", hint="use text, json_object or json_schema")


def _is_function(tool: ResponseTool) -> bool:
    if tool.type == "function":
        if not tool.name:
            raise InvalidInput("a function tool needs a name")
        return True
    log.warning("left out the %s tool %s: only function tools run on a local model", tool.type, tool.name or "")
    return False


def _tool(tool: ResponseTool) -> api.Tool:
    return api.Tool(
        function=api.ToolFunction(
            name=tool.name, description=tool.description or "", parameters=tool.parameters or {"type": "object"}
        )
    )


# ---------------------------------------------------------------------------------------------------------- input


def input_messages(items: str | list[dict[str, Any]], earlier_calls: dict[str, str] | None = None) -> list[api.Message]:
    """The input as messages; a function_call_output names its tool, found by call_id here or in `earlier_calls`
    (call_id → name, from the stored conversation)."""
    if isinstance(items, str):
        return [api.Message(role="user", content=items)]
    out: list[api.Message] = []
    names: dict[str, str] = dict(earlier_calls or {})
    thinking = ""
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            out.append(_message(item, where, thinking))
            thinking = ""
        elif kind == "reasoning":
            thinking += "".join(str(p.get("text", "")) for p in (item.get("content") or item.get("summary") or []))
        elif kind == "function_call":
            call = _function_call(item, where)
            names[str(item.get("call_id", ""))] = call.function.name
            turn = _assistant_turn(out, thinking)
            turn.tool_calls = [*(turn.tool_calls or []), call]
            thinking = ""
        elif kind == "compaction":
            out.append(summary_message(unseal(item.get("encrypted_content"), where)))
            thinking = ""
        elif kind == "compaction_trigger":
            raise InvalidInput(f"{where}: a compaction_trigger must be the last input item")
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append(
                api.Message(
                    role="tool",
                    content=output if isinstance(output, str) else json.dumps(output),
                    tool_name=names.get(str(item.get("call_id", ""))),
                )
            )
        else:
            raise InvalidInput(
                f"{where}: items of type {kind!r} are not supported",
                hint="send messages, function_call, function_call_output, reasoning and compaction items",
            )
    return out


def input_item_records(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This turn's input as GET /v1/responses/{id}/input_items lists it: every item typed and with an id."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    records = []
    for item in items:
        record = {"type": "message", **item}
        if record["type"] == "message" and isinstance(record.get("content"), str):
            record["content"] = [{"type": "input_text", "text": record["content"]}]
        record.setdefault("id", f"{'msg' if record['type'] == 'message' else 'item'}_{uuid.uuid4().hex[:32]}")
        records.append(record)
    return records


def _message(item: dict[str, Any], where: str, thinking: str) -> api.Message:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidInput(f"{where}.role {role!r} is not valid", hint="use user, system, developer or assistant")
    content = item.get("content", "")
    images: list[str] = []
    if isinstance(content, list):
        parts = [(part, f"{where}.content.{j}") for j, part in enumerate(content)]
        images = [_part_image(part, at) for part, at in parts if part.get("type") == "input_image"]
        content = "".join(_part_text(part, at) for part, at in parts if part.get("type") != "input_image")
    return api.Message(
        role="system" if role == "developer" else role,
        content=str(content),
        images=images or None,
        thinking=thinking or None if role == "assistant" else None,
    )


def _part_text(part: dict[str, Any], where: str) -> str:
    if part.get("type") not in ("input_text", "output_text", "text"):
        raise InvalidInput(
            f"{where}: content parts of type {part.get('type')!r} are not supported",
            hint="send input_text, output_text and input_image parts",
        )
    return str(part.get("text", ""))


def _part_image(part: dict[str, Any], where: str) -> str:
    """An input_image's base64 data, from its data: URI (a message's images go before its text)."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise InvalidInput(
            f"{where}: an input_image needs an image_url (file_id is not supported: no files are stored here)",
            hint="send image_url as a data: URI (data:image/png;base64,...)",
        )
    return data_uri_image(url, where=f"{where}.image_url")


def _function_call(item: dict[str, Any], where: str) -> api.ToolCall:
    arguments = item.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise InvalidInput(f"{where}.arguments is not valid JSON: {str(arguments)[:80]!r}") from None
    if not isinstance(parsed, dict):
        raise InvalidInput(f"{where}.arguments must be a JSON object")
    return api.ToolCall(
        id=item.get("call_id"), function=api.ToolCallFunction(name=str(item.get("name", "")), arguments=parsed)
    )


def _assistant_turn(out: list[api.Message], thinking: str) -> api.Message:
    """The assistant message a function_call belongs to: the last one when it ends the list, else a new one."""
    if not out or out[-1].role != "assistant":
        out.append(api.Message(role="assistant", content="", thinking=thinking or None))
    return out[-1]
