"""Anthropic's Messages request body and its translation into our api.ChatRequest.

The wire types live here, as OpenAI's live in openai/requests.py: only these routes speak them. Content blocks become
our messages: text joins into content, a `tool_use` becomes a tool call (several in one turn stay one turn), a
`tool_result` a tool message (`is_error` marks its text as an error), a `thinking` block the assistant's thinking.
`cache_control` is accepted anywhere: our prefix cache reuses every prefix without marks. Claude Code's billing line
is left out of the system prompt (billing_header.py). An `image` block with a base64 source in a user turn goes
before the turn's text; what cannot be expressed (documents, image URLs, images elsewhere) is a 400 naming the
block. Server tools (web search, code execution) cannot run here: they are left out with a warning in the log, so
an agent that always sends them still works. Fields accepted but without effect here are named by `ignored()`, which
the route reports in the X-LocalLLM-Ignored header: nothing is dropped in silence."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ... import api
from ...errors import InvalidInput
from ..billing_header import strip_billing_header
from ..ignored import RequestBody

log = logging.getLogger(__name__)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class AnthropicMessage(_Wire):
    # "system" inside messages: Claude Code sends one after the first user turn (its mid-conversation-system beta)
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Wire):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class MessagesRequest(RequestBody):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=api.MAX_MESSAGES)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=64)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = Field(
        None, description="format (a JSON schema) is honoured; effort is accepted and left to the model"
    )
    output_format: dict[str, Any] | None = Field(None, description="the older name of output_config.format")
    metadata: dict[str, Any] | None = Field(None, description="user_id only, as Anthropic's; it has no effect here")
    stream: bool = False


class CountTokensRequest(RequestBody):
    """count_tokens takes the same body less max_tokens and the sampling fields."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=api.MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    stream: bool = Field(False, description="clients that reuse a messages body send it; a count never streams")


# ---------------------------------------------------------------------------------------------------------- request


def chat_request(body: MessagesRequest | CountTokensRequest) -> api.ChatRequest:
    leading, rest = _leading_system(body.messages)
    if not rest:
        raise InvalidInput("messages: at least one user message is required", hint="send the conversation's turns")
    messages = chat_messages(rest, first=len(leading))
    if isinstance(body, MessagesRequest):
        check_metadata(body.metadata)
        check_budget(body.thinking, body.max_tokens)
    system = "\n\n".join(text for text in [system_text(body.system), *leading] if text)
    if system:
        messages.insert(0, api.Message(role="system", content=system))
    tools = [_tool(t) for t in body.tools or [] if _runs_locally(t)] or None
    options: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        options = {
            "num_predict": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
        }
    return api.ChatRequest(
        model=body.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice(body.tool_choice),
        think=think(body.thinking),
        stream=body.stream if isinstance(body, MessagesRequest) else False,
        format=output_format(body.output_config, body.output_format),
        options={name: value for name, value in options.items() if value is not None},
    )


def output_format(config: dict[str, Any] | None, legacy: dict[str, Any] | None) -> api.Format:
    """Structured outputs: {"type": "json_schema", "schema": {...}} as the schema our grammar takes."""
    fmt = (config or {}).get("format") or legacy
    if not fmt:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidInput('output_config.format must be {"type": "json_schema", "schema": {...}}')
    return fmt["schema"]


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """The system prompt: its text blocks joined, Claude Code's billing line left out (a block that held only the
    line is left out whole, so the prompt is the one without it)."""
    if system is None or isinstance(system, str):
        return strip_billing_header(system or "")
    texts = (strip_billing_header(_text_block(block, f"system.{i}")) for i, block in enumerate(system))
    return "\n\n".join(text for text in texts if text)


def ignored(body: MessagesRequest | CountTokensRequest) -> list[str]:
    """The fields of `body` accepted without effect, each with why: reported to the client, never dropped silently."""
    notes = [f"{name} (not part of the Messages API)" for name in sorted(body.model_extra or {})]
    if (body.thinking or {}).get("budget_tokens") is not None:
        notes.append("thinking.budget_tokens (max_tokens bounds the whole answer, thinking included)")
    if isinstance(body, MessagesRequest) and body.metadata:
        notes.append("metadata (no effect on a local model)")
    if isinstance(body, CountTokensRequest) and body.stream:
        notes.append("stream (a token count is one answer)")
    return notes


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """Anthropic's metadata holds only user_id, a string; anything else is a mistake worth a 400."""
    for name, value in (metadata or {}).items():
        if name != "user_id":
            raise InvalidInput(f"metadata.{name} is not valid", hint="metadata takes only user_id")
        if value is not None and (not isinstance(value, str) or len(value) > 256):
            raise InvalidInput("metadata.user_id must be a string of at most 256 characters")


def think(thinking: dict[str, Any] | None) -> bool | None:
    """{"type": "enabled", "budget_tokens": N} turns thinking on, {"type": "disabled"} off. The budget is checked
    but not enforced: the answer as a whole is bounded by max_tokens."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind in ("enabled", "adaptive"):
        budget = thinking.get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise InvalidInput(f"thinking.budget_tokens {budget!r} must be a whole number of at least 1")
        return True
    raise InvalidInput(f"thinking.type {kind!r} is not valid", hint="use enabled or disabled")


def check_budget(thinking: dict[str, Any] | None, max_tokens: int) -> None:
    """Anthropic's rule: the thinking budget is part of max_tokens, so it must be smaller."""
    budget = (thinking or {}).get("budget_tokens")
    if (thinking or {}).get("type") == "enabled" and isinstance(budget, int) and budget >= max_tokens:
        raise InvalidInput(
            f"thinking.budget_tokens {budget} must be less than max_tokens {max_tokens}",
            hint="raise max_tokens or lower the budget",
        )


def parallel_tools(choice: dict[str, Any] | None) -> bool:
    """False when tool_choice says disable_parallel_tool_use: the answer then holds at most one tool call."""
    return not (choice or {}).get("disable_parallel_tool_use", False)


def tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Anthropic's choices as OpenAI's, whose forced forms (any, tool) take the tool-call grammar."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not name:
            raise InvalidInput('tool_choice {"type": "tool"} needs the tool\'s name')
        return {"type": "function", "function": {"name": name}}
    raise InvalidInput(f"tool_choice.type {kind!r} is not valid", hint="use auto, any, tool or none")


def _runs_locally(tool: AnthropicTool) -> bool:
    if tool.type in (None, "custom"):
        return True
    log.warning("left out the server tool %s (%s): it cannot run on a local model", tool.name, tool.type)
    return False


def _tool(tool: AnthropicTool) -> api.Tool:
    return api.Tool(
        function=api.ToolFunction(name=tool.name, description=tool.description, parameters=tool.input_schema)
    )


# ---------------------------------------------------------------------------------------------------------- messages


def _leading_system(messages: list[AnthropicMessage]) -> tuple[list[str], list[AnthropicMessage]]:
    """System messages before the first turn are part of the system prompt; the turns from there on."""
    start = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    return [_system_message_text(m, f"messages.{i}") for i, m in enumerate(messages[:start])], messages[start:]


def chat_messages(messages: list[AnthropicMessage], first: int = 0) -> list[api.Message]:
    """Anthropic messages as ours. A tool_result names its call by id; we name the tool, found from that id. A
    system message between turns becomes a `<system-reminder>` in a user turn (most local models' templates take a
    system prompt only at the start), placed so that it renders the same once later turns follow: after a user turn
    it joins that turn (Claude Code sends it there, last, and the next request's prefix must match); after an
    assistant turn it leads the next user turn, as Anthropic's own fallback puts it."""
    tool_names: dict[str, str] = {}
    out: list[api.Message] = []
    reminders: list[str] = []
    previous = ""
    for i, message in enumerate(messages, start=first):
        if message.role == "system":
            text = _system_message_text(message, f"messages.{i}")
            if previous == "user":
                _join_reminder(out, text)
            else:
                reminders.append(text)
            continue
        previous = message.role
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            out.append(_assistant(blocks, f"messages.{i}.content", tool_names))
        else:
            out.extend(_user(blocks, f"messages.{i}.content", tool_names, reminders))
            reminders = []
    if reminders:  # nothing after them: they stand as a user turn of their own
        out.append(api.Message(role="user", content=_reminder_text(reminders)))
    return out


def _join_reminder(out: list[api.Message], text: str) -> None:
    """A reminder after the user turn that ends `out`: appended to its text, or its own user turn after tool
    results (two user turns in a row break templates that check alternation)."""
    if not text:
        return
    last = out[-1]
    if last.role != "user":
        out.append(api.Message(role="user", content=_reminder_text([text])))
        return
    content = last.content or ""
    separator = "\n" if content and not content.endswith("\n") else ""
    out[-1] = last.model_copy(update={"content": content + separator + _reminder_text([text])})


def _system_message_text(message: AnthropicMessage, where: str) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(_text_block(block, f"{where}.content.{j}") for j, block in enumerate(message.content))


def _reminder_text(reminders: list[str]) -> str:
    return "".join(f"<system-reminder>\n{text}\n</system-reminder>\n" for text in reminders if text)


def _assistant(blocks: list[dict[str, Any]], where: str, tool_names: dict[str, str]) -> api.Message:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, f"{where}.{j}"))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # opaque by design; nothing a local model can read
        elif kind == "tool_use":
            call = api.ToolCall(
                id=block.get("id"),
                function=api.ToolCallFunction(
                    name=str(block.get("name", "")), arguments=_tool_input(block.get("input"), f"{where}.{j}.input")
                ),
            )
            tool_names[call.id or ""] = call.function.name
            calls.append(call)
        else:
            raise _unsupported(kind, f"{where}.{j}")
    return api.Message(
        role="assistant", content="".join(texts), thinking="".join(thinking) or None, tool_calls=calls or None
    )


def _user(
    blocks: list[dict[str, Any]], where: str, tool_names: dict[str, str], reminders: list[str]
) -> list[api.Message]:
    """Tool results first (they answer the previous turn's calls), then the user's own text, after the system
    reminders that came before the turn."""
    results: list[api.Message] = []
    texts, images = [_reminder_text(reminders)] if reminders else [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, f"{where}.{j}"))
        elif kind == "image":
            images.append(_image_block(block, f"{where}.{j}"))
        elif kind == "tool_result":
            results.append(
                api.Message(
                    role="tool",
                    content=_result_text(block, f"{where}.{j}"),
                    tool_name=tool_names.get(str(block.get("tool_use_id", ""))),
                )
            )
        else:
            raise _unsupported(kind, f"{where}.{j}")
    user = api.Message(role="user", content="".join(texts), images=images or None)
    return results + ([user] if texts or images or not results else [])


def _image_block(block: dict[str, Any], where: str) -> str:
    """An image block's base64 data; a URL source is refused (the server never fetches one)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64" or not isinstance(source.get("data"), str):
        kind = source.get("type") if isinstance(source, dict) else None
        raise InvalidInput(
            f"{where}.source: image sources of type {kind!r} are not supported (the server never fetches a URL)",
            hint='send {"type": "base64", "media_type": "image/png", "data": ...}',
        )
    return source["data"]


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    else:
        text = "".join(_text_block(part, f"{where}.content.{k}") for k, part in enumerate(content or []))
    return f"Error: {text}" if block.get("is_error") else text


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise _unsupported(block.get("type") if isinstance(block, dict) else type(block).__name__, where)
    return str(block.get("text", ""))


def _tool_input(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be an object, got {type(value).__name__}")
    return value


def _unsupported(kind: Any, where: str) -> InvalidInput:
    if kind in ("image", "document"):
        return InvalidInput(
            f"{where}: {kind} blocks are accepted only in a user turn (images), as base64",
            hint="send text, tool_use, tool_result and thinking blocks, and images in user turns",
        )
    return InvalidInput(
        f"{where}: content blocks of type {kind!r} are not supported",
        hint="send text, tool_use, tool_result and thinking blocks; no vision model backend exists",
    )
