"""Structured output and forced tool calls: grammars that constrain sampling (the calls are parsed in tool_calls.py).

`format` ("json" or a JSON schema) and forced tool calls become GBNF grammars for llama.cpp's grammar sampler, so the
output is valid by construction. JSON schema to GBNF is schema_grammar's: llama.cpp's converter, bounded."""

from __future__ import annotations

from typing import Any

from ..api import Format, Tool
from ..errors import InvalidInput
from .schema_grammar import MAX_REPEAT, check_schema_shape, schema_grammar


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


def tool_call_schema(tools: list[Tool], *, name: str | None = None, arguments_key: str = "arguments") -> dict[str, Any]:
    """Schema of one call {"name": ..., "arguments": {...}} to any of `tools` (or only to `name`); Llama 3's
    calls name their arguments "parameters" (`arguments_key`)."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    if not chosen:
        raise InvalidInput(f"tool_choice names {name!r}, which is not among the tools")
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                arguments_key: grammar_parameters(t.function.parameters or {"type": "object"}),
            },
            "required": ["name", arguments_key],
        }
        for t in chosen
    ]
    return variants[0] if len(variants) == 1 else {"oneOf": variants}


def grammar_parameters(schema: Any) -> Any:
    """A tool's parameters as its call grammar holds them: an upper bound past the grammar's repetition limit is
    dropped (agents' tools carry sizes like maxLength 524288 that no grammar needs); everything else stays."""
    if isinstance(schema, list):
        return [grammar_parameters(value) for value in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: grammar_parameters(value)
        for key, value in schema.items()
        if not (key in UPPER_BOUNDS and _past_repeat_bound(value))
    }


UPPER_BOUNDS = ("maxItems", "maxLength", "maxProperties")


def _past_repeat_bound(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > MAX_REPEAT


def tool_choice_grammar(tools: list[Tool] | None, tool_choice: Any) -> str | None:
    """A grammar forcing a tool call when tool_choice is "required" or names a function; else None. Every tool's
    parameters are checked for size and depth, forced or not; the bounds that only a grammar needs are checked
    where a grammar is built."""
    for tool in tools or []:
        if tool.function.parameters:
            check_schema_shape(tool.function.parameters, f"tool {tool.function.name} parameters")
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return schema_grammar(tool_call_schema(tools))
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return schema_grammar(tool_call_schema(tools, name=name))
    raise InvalidInput(f"tool_choice {tool_choice!r} is not valid", hint='use "auto", "none", "required" or a function')
