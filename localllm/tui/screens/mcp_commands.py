"""MCP prompts and resources in the TUI, as the terminal chat has them (mcp/prompts.py does the work for both):
`/prompt` lists the servers' prompts and `/prompt NAME ARGS` sends one as the next message; `/resource` lists the
servers' resources and `/resource URI` attaches one in front of the next message. They run in a worker thread (a
server may start first); what they say is a notification."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import InvalidInput
from ...mcp.prompts import listed_prompts, listed_resources, prompt_arguments, prompt_text, resource_text
from ...mcp.tool_loop import Toolbox

COMMANDS = ("/prompt", "/resource")


@dataclass(frozen=True)
class CommandResult:
    """What a command did: something to tell the user, and a message to send (a prompt's text)."""

    said: str = ""
    send: str | None = None


def is_mcp_command(text: str) -> bool:
    return text.split(maxsplit=1)[0] in COMMANDS if text.strip() else False


class McpCommands:
    """/prompt and /resource over the chat's toolbox; the attached resources wait here for the next message."""

    def __init__(self, toolbox: Toolbox):
        self.toolbox = toolbox
        self.attached: list[tuple[str, str]] = []  # (uri, text)

    def run(self, line: str, on_note: Callable[[str], None]) -> CommandResult:
        command, _, rest = line.strip().partition(" ")
        if command == "/prompt":
            return self._prompt(rest, on_note)
        return self._resource(rest, on_note)

    def take_attached(self) -> list[tuple[str, str]]:
        attached, self.attached = self.attached, []
        return attached

    def _prompt(self, rest: str, on_note: Callable[[str], None]) -> CommandResult:
        words = shlex.split(rest)
        prompts = listed_prompts(self.toolbox, on_note)
        if not words:
            lines = []
            for prompt in prompts.values():
                names = " ".join(f"{name}{'' if name in prompt.required else '?'}" for name in prompt.arguments)
                summary = f" — {prompt.description}" if prompt.description else ""
                lines.append(f"{prompt.server}: /prompt {prompt.name} {names}{summary}")
            return CommandResult("\n".join(lines) or "the MCP servers offer no prompts")
        if words[0] not in prompts:
            raise InvalidInput(f"no MCP prompt named {words[0]!r}", hint="/prompt lists them")
        prompt = prompts[words[0]]
        return CommandResult(send=prompt_text(self.toolbox, prompt, prompt_arguments(prompt, words[1:])))

    def _resource(self, rest: str, on_note: Callable[[str], None]) -> CommandResult:
        uri = rest.strip()
        resources = listed_resources(self.toolbox, on_note)
        if not uri:
            lines = [f"{resource.server}: {resource.uri}  {resource.name}" for resource in resources.values()]
            return CommandResult("\n".join(lines) or "the MCP servers offer no resources")
        if uri not in resources:
            raise InvalidInput(f"no MCP resource {uri!r}", hint="/resource lists them")
        text = resource_text(self.toolbox, resources[uri])
        self.attached.append((uri, text))
        return CommandResult(f"Attached {uri} to the next message ({len(text)} characters)")
