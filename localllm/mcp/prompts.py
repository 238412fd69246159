"""MCP prompts and resources as every chat surface uses them (the terminal chat's /prompt and /resource, the TUI's,
the web page's routes): the enabled servers' listings, a prompt's arguments from the words the user typed, and
attached resources put in front of a question, as files attached in the web page are."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..errors import InvalidInput, LocalLLMError
from .sessions import McpPrompt, McpResource
from .tool_loop import MAX_RESULT_CHARS, Toolbox, bound_text

T = TypeVar("T")


def each_enabled(toolbox: Toolbox, listing: Callable[[str], list[T]], on_note: Callable[[str], None]) -> list[T]:
    """`listing` over the servers that are on; a server that fails is a note, not the end of the command."""
    found: list[T] = []
    for server, on in toolbox.enabled.items():
        if on:
            try:
                found += listing(server)
            except LocalLLMError as exc:
                on_note(f"MCP server {server!r}: {exc}")
    return found


def listed_prompts(toolbox: Toolbox, on_note: Callable[[str], None]) -> dict[str, McpPrompt]:
    return {prompt.name: prompt for prompt in each_enabled(toolbox, toolbox.sessions.prompts, on_note)}


def listed_resources(toolbox: Toolbox, on_note: Callable[[str], None]) -> dict[str, McpResource]:
    return {resource.uri: resource for resource in each_enabled(toolbox, toolbox.sessions.resources, on_note)}


def prompt_arguments(prompt: McpPrompt, words: list[str]) -> dict[str, str]:
    """A prompt's arguments from NAME=VALUE words, or values in the order the prompt lists its arguments."""
    arguments: dict[str, str] = {}
    for position, word in enumerate(words):
        name, sep, value = word.partition("=")
        if sep and name in prompt.arguments:
            arguments[name] = value
        elif position < len(prompt.arguments):
            arguments[prompt.arguments[position]] = word
        else:
            raise InvalidInput(f"/prompt {prompt.name} takes {len(prompt.arguments)} argument(s), not {word!r}")
    missing = [name for name in prompt.required if name not in arguments]
    if missing:
        raise InvalidInput(f"/prompt {prompt.name} needs {', '.join(missing)}", hint=f"/prompt {prompt.name} VALUE…")
    return arguments


def prompt_text(toolbox: Toolbox, prompt: McpPrompt, arguments: dict[str, str]) -> str:
    """The prompt's messages as one text, to send as the user's next message."""
    messages = toolbox.sessions.get_prompt(prompt.server, prompt.name, arguments)
    return "\n\n".join(text for _, text in messages)


def resource_text(toolbox: Toolbox, resource: McpResource) -> str:
    """A resource's text, bounded as a tool's result is."""
    text, _ = bound_text(toolbox.sessions.read_resource(resource.server, resource.uri), MAX_RESULT_CHARS)
    return text


def with_resources(question: str, attached: list[tuple[str, str]]) -> str:
    """The attached resources, as (uri, text), in front of the question."""
    context = "".join(f"Resource {uri}:\n```\n{text}\n```\n\n" for uri, text in attached)
    return context + question
