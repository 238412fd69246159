"""OpenAI's Responses request body (what Codex speaks) and its translation into our api.ChatRequest.

`input` is a string or a list of items: messages (with input_text / output_text parts), `function_call` and
`function_call_output`, and `reasoning` (its text becomes the next assistant turn's thinking). `instructions` is the
system prompt of this turn only; `previous_response_id` puts the stored conversation before the new input. Tools
other than functions (web search, a local shell, custom grammar tools) cannot run here: they are left out with a
warning in the log, so an agent that always sends them still works."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ... import api
from ...chat.thinking import think_from_effort
from ...errors import InvalidInput

log = logging.getLogger(__name__)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class ResponseTool(_Wire):
    type: str = "function"
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Wire):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
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
    parallel_tool_calls: bool = True
    keep_alive: api.Duration | None = Field(None, description="Ollama's keep_alive (extension)")


# ---------------------------------------------------------------------------------------------------------- request


def chat_request(body: ResponsesRequest, history: list[api.Message]) -> api.ChatRequest:
    """The chat request for one turn: this turn's instructions, the stored conversation (`history`), its input."""
    calls = {call.id: call.function.name for m in history for call in m.tool_calls or [] if call.id}
    messages = turn_instructions(body) + list(history) + input_messages(body.input, calls)
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
    )


def turn_instructions(body: ResponsesRequest) -> list[api.Message]:
    """`instructions` as the system message of this turn only: OpenAI does not carry them to the next turn, so the
    stored conversation leaves them out."""
    return [api.Message(role="system", content=body.instructions)] if body.instructions else []


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
                hint="send messages, function_call, function_call_output and reasoning items",
            )
    return out


def _message(item: dict[str, Any], where: str, thinking: str) -> api.Message:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidInput(f"{where}.role {role!r} is not valid", hint="use user, system, developer or assistant")
    content = item.get("content", "")
    if isinstance(content, list):
        content = "".join(_part_text(part, f"{where}.content.{j}") for j, part in enumerate(content))
    return api.Message(
        role="system" if role == "developer" else role,
        content=str(content),
        thinking=thinking or None if role == "assistant" else None,
    )


def _part_text(part: dict[str, Any], where: str) -> str:
    if part.get("type") not in ("input_text", "output_text", "text"):
        raise InvalidInput(
            f"{where}: content parts of type {part.get('type')!r} are not supported",
            hint="send text only; no vision model backend exists in localllm yet",
        )
    return str(part.get("text", ""))


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
