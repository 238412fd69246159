"""Structured output and tool calls: grammars that constrain sampling, and parsing of the tool calls models emit.

`format` ("json" or a JSON schema) and forced tool calls become GBNF grammars for llama.cpp's grammar sampler, so the
output is valid by construction. JSON schema to GBNF is schema_grammar's: llama.cpp's converter, bounded."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ..api import Format, Tool, ToolCall, ToolCallDelta, ToolCallFunction
from ..errors import InvalidInput
from .schema_grammar import check_schema, schema_grammar


def grammar_for_format(fmt: Format) -> str | None:
    """GBNF for Ollama's `format`: None/"" no constraint, "json" any JSON object, a dict a JSON schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        from llama_cpp.llama_grammar import JSON_GBNF

        return JSON_GBNF
    if isinstance(fmt, dict):
        return schema_grammar(fmt, "format")
    raise InvalidInput(f"format {fmt!r} is not valid", hint='use "json" or a JSON schema object')


def tool_call_schema(tools: list[Tool], *, name: str | None = None) -> dict[str, Any]:
    """Schema of one call {"name": ..., "arguments": {...}} to any of `tools` (or only to `name`)."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    if not chosen:
        raise InvalidInput(f"tool_choice names {name!r}, which is not among the tools")
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in chosen
    ]
    return variants[0] if len(variants) == 1 else {"oneOf": variants}


def tool_choice_grammar(tools: list[Tool] | None, tool_choice: Any) -> str | None:
    """A grammar forcing a tool call when tool_choice is "required" or names a function; else None. Every tool's
    parameters are held to the schema bounds, forced or not, so a request's fate does not hang on tool_choice."""
    for tool in tools or []:
        if tool.function.parameters:
            check_schema(tool.function.parameters, f"tool {tool.function.name} parameters")
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return schema_grammar(tool_call_schema(tools))
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return schema_grammar(tool_call_schema(tools, name=name))
    raise InvalidInput(f"tool_choice {tool_choice!r} is not valid", hint='use "auto", "none", "required" or a function')


_TAGGED = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_calls(text: str, tools: list[Tool] | None) -> tuple[str, list[ToolCall]]:
    """Split model output into (content, tool calls). Understands Hermes-style <tool_call>{...}</tool_call> blocks
    and a bare JSON object or list of {"name", "arguments"} naming a known tool (what forced calls produce)."""
    if not tools:
        return text, []
    known = {t.function.name for t in tools}
    calls = [c for c in (_as_call(m, known) for m in _TAGGED.findall(text)) if c]
    if calls:
        return _TAGGED.sub("", text).strip(), calls
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            data = json.loads(stripped)
        except ValueError:
            return text, []
        items = data if isinstance(data, list) else [data]
        calls = [c for c in (_as_call(json.dumps(i), known) for i in items) if c]
        if calls and len(calls) == len(items):
            return "", calls
    return text, []


def _as_call(raw: str, known: set[str]) -> ToolCall | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in known:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", function=ToolCallFunction(name=data["name"], arguments=args))


_CALL_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.S)


class ForcedCallStream:
    """A forced tool call ({"name": ..., "arguments": {...}}, the grammar of tool_call_schema) parsed as it streams:
    `feed` returns the deltas that became known: the id and name once the name is complete, then the arguments'
    text. The last `}` seen is held back, since it may close the call rather than the arguments."""

    def __init__(self) -> None:
        self.text = ""
        self.id = f"call_{uuid.uuid4().hex[:12]}"
        self.name: str | None = None
        self._args_start = 0
        self._sent = 0  # characters of the arguments already sent

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        deltas: list[ToolCallDelta] = []
        if self.name is None:
            head = _CALL_HEAD.match(self.text)
            if head is None:
                return deltas
            self.name = json.loads(f'"{head.group(1)}"')
            self._args_start = head.end()
            deltas.append(ToolCallDelta(id=self.id, name=self.name))
        arguments = self.text[self._args_start :]
        safe = len(arguments.rstrip().removesuffix("}")) if arguments.rstrip().endswith("}") else len(arguments)
        if safe > self._sent:
            deltas.append(ToolCallDelta(arguments=arguments[self._sent : safe]))
            self._sent = safe
        return deltas

    def finish(self) -> list[ToolCallDelta]:
        """The arguments' last piece, once the answer has ended (complete, or cut off by num_predict)."""
        if self.name is None:
            return []
        arguments = self.arguments()
        rest = arguments[self._sent :]
        self._sent = len(arguments)
        return [ToolCallDelta(arguments=rest)] if rest else []

    def arguments(self) -> str:
        """The arguments' text: all of it for a complete call, what was generated for a cut-off one."""
        raw = self.text[self._args_start :] if self.name is not None else ""
        complete = self.complete()
        if complete is not None:
            return json.dumps(complete.function.arguments) if not raw else raw.rstrip().removesuffix("}").rstrip()
        return raw

    def complete(self) -> ToolCall | None:
        """The call, when the text is one whole call; None when it was cut off."""
        try:
            data = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("arguments"), dict) or "name" not in data:
            return None
        return ToolCall(id=self.id, function=ToolCallFunction(name=str(data["name"]), arguments=data["arguments"]))
