"""MCP tools in the terminal chat: the answer goes through the shared tool loop (mcp/tool_loop.py), each call is shown
(server, tool, arguments) and, unless trusted, asked about (yes / no / always), and `/tools` lists the servers and
turns them on or off for the session. Ctrl-C stops a running tool as it stops an answer."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from ..client.protocol import Client
from ..conversation import Conversation
from ..errors import InvalidInput, LocalLLMError
from ..mcp.prompts import listed_prompts, listed_resources, prompt_arguments, prompt_text, resource_text, with_resources
from ..mcp.tool_loop import CallOutcome, Decision, PendingCall, Toolbox, ToolLoop, open_toolbox
from .app import console, err_console, print_error
from .interrupts import interrupt_handled
from .render import MarkdownStream, RawStream, print_timings

CONFIRM = "Run it? [y]es / [n]o / [a]lways for this tool: "
ANSWERS: dict[str, Decision] = {"y": "yes", "yes": "yes", "n": "no", "no": "no", "a": "always", "always": "always"}
SHOWN_RESULT_CHARS = 400  # of a result, in the chat (the model gets up to the loop's bound)

HELP_TOOLS = """Available Commands:
  /tools              List the MCP servers and their tools
  /tools on SERVER    Offer a server's tools again (this chat)
  /tools off SERVER   Stop offering a server's tools (this chat)
  /prompt             List the servers' prompts
  /prompt NAME ARGS   Send a server's prompt (ARGS: values in order, or NAME=VALUE)
  /resource           List the servers' resources
  /resource URI       Attach a resource to the next message"""


class TerminalToolView:
    """The loop's view in the terminal: answers drawn as the chat draws them, calls and results as dim lines, the
    confirmation read with the chat's line reader."""

    def __init__(
        self,
        read_line: Callable[[str], str],
        quiet_keys: Callable[[], AbstractContextManager[None]],
        *,
        wordwrap: bool,
        hide_thinking: bool,
    ):
        self._read_line = read_line
        self._quiet_keys = quiet_keys  # keys unechoed while an answer is drawn (line_input.keys_not_echoed)
        self._wordwrap = wordwrap
        self._hide_thinking = hide_thinking
        self._open = ExitStack()
        self._stream: MarkdownStream | RawStream | None = None
        self.parts: list[str] = []

    def text(self, piece: str) -> None:
        self.parts.append(piece)
        self._drawing().write(piece)

    def thinking(self, piece: str) -> None:
        if not self._hide_thinking:
            self._drawing().think(piece)

    def note(self, text: str) -> None:
        self.close()
        console.print(f"[yellow]note:[/] {text}", highlight=False)

    def calling(self, call: PendingCall) -> None:
        self.close()
        console.print("[bold cyan]tool call[/] ", end="", highlight=False)
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        console.print(f"{call.server} › {call.tool} {arguments}", highlight=False, markup=False)

    def confirm(self, call: PendingCall) -> Decision:
        while True:
            answer = self._read_line(CONFIRM).strip().lower()
            if answer in ANSWERS:
                return ANSWERS[answer]
            console.print("answer y, n or a", style="dim", highlight=False)

    def result(self, call: PendingCall, outcome: CallOutcome) -> None:
        text = outcome.text if len(outcome.text) <= SHOWN_RESULT_CHARS else outcome.text[:SHOWN_RESULT_CHARS] + "…"
        style = {"ok": "green", "error": "red", "declined": "yellow"}[outcome.status]
        label = {"ok": "result", "error": "tool error", "declined": "declined"}[outcome.status]
        cut = " (cut to the size limit)" if outcome.truncated else ""
        console.print(f"[{style}]{label}{cut}:[/] ", end="", highlight=False)
        console.print(text, style="dim", highlight=False, markup=False)

    def cancelled(self) -> bool:
        return False  # the terminal stops a tool by Ctrl-C, a signal

    def close(self) -> None:
        self._open.close()
        self._stream = None

    def _drawing(self) -> MarkdownStream | RawStream:
        if self._stream is not None:
            return self._stream
        self._open.enter_context(self._quiet_keys())
        stream: MarkdownStream | RawStream = MarkdownStream(console) if self._wordwrap else RawStream(console)
        self._open.enter_context(stream)
        self._stream = stream
        return stream


class ChatTools:
    """The terminal chat's tools: the toolbox of this session and the loop over it."""

    def __init__(self, client: Client, toolbox: Toolbox):
        self.toolbox = toolbox
        self.loop = ToolLoop(client, toolbox)
        self.attached: list[tuple[str, str]] = []  # (uri, text) of resources for the next message

    def answer(
        self,
        conversation: Conversation,
        read_line: Callable[[str], str],
        quiet_keys: Callable[[], AbstractContextManager[None]],
        *,
        wordwrap: bool,
        hide_thinking: bool,
        verbose: bool,
    ) -> None:
        """Answer the conversation's last question with tools; Ctrl-C stops the answer or the tool, errors are one
        line, and the chat goes on."""
        view = TerminalToolView(read_line, quiet_keys, wordwrap=wordwrap, hide_thinking=hide_thinking)
        self.attach_resources(conversation)
        final = None
        try:
            final = self.loop.answer(conversation, view)
        except KeyboardInterrupt:
            view.close()
            interrupt_handled()
            console.print("[dim](stopped)[/]", highlight=False)
        except LocalLLMError as exc:
            view.close()
            print_error(exc)
        view.close()
        if final is not None and verbose:
            print_timings(final, to=err_console)

    def command(self, rest: str) -> None:
        """/tools, /tools on SERVER, /tools off SERVER."""
        words = rest.split()
        if not words:
            self._list()
            return
        if words[0].lower() not in ("on", "off") or len(words) != 2:
            raise InvalidInput(f"unknown /tools option {rest.strip()!r}", hint="/tools, /tools on|off SERVER")
        on = words[0].lower() == "on"
        try:
            self.toolbox.set_enabled(words[1], on)
        except LocalLLMError as exc:
            raise InvalidInput(str(exc)) from None
        console.print(f"MCP server '{words[1]}' is {'on' if on else 'off'} for this chat", highlight=False)

    def _list(self) -> None:
        offered = self.toolbox.offered(self._note)
        for entry in self.toolbox.entries:
            on = self.toolbox.enabled[entry.name]
            trust = ", trusted" if entry.trust or self.toolbox.trust_all else ""
            console.print(f"[bold]{entry.name}[/] ({'on' if on else 'off'}{trust})", highlight=False)
            for name, tool in offered.items():
                if tool.server == entry.name:
                    summary = tool.description.strip().splitlines()[0][:80] if tool.description.strip() else ""
                    console.print(f"  {name:<24} {summary}", highlight=False, markup=False, soft_wrap=True)

    # ----------------------------------------------------------------------------------------------- prompts, resources

    def prompt(self, rest: str) -> str | None:
        """/prompt lists the servers' prompts; /prompt NAME ARGS returns the prompt's text, to send as a message."""
        words = shlex.split(rest)
        prompts = listed_prompts(self.toolbox, self._note)
        if not words:
            for prompt in prompts.values():
                names = " ".join(f"{name}{'' if name in prompt.required else '?'}" for name in prompt.arguments)
                console.print(f"{prompt.server}: /prompt {prompt.name} {names}", highlight=False, markup=False)
                if prompt.description:
                    console.print(f"  {prompt.description}", style="dim", highlight=False, markup=False)
            if not prompts:
                console.print("the MCP servers offer no prompts", highlight=False)
            return None
        if words[0] not in prompts:
            raise InvalidInput(f"no MCP prompt named {words[0]!r}", hint="/prompt lists them")
        prompt = prompts[words[0]]
        return prompt_text(self.toolbox, prompt, prompt_arguments(prompt, words[1:]))

    def resource(self, rest: str) -> None:
        """/resource lists the servers' resources; /resource URI attaches one to the next message."""
        uri = rest.strip()
        resources = listed_resources(self.toolbox, self._note)
        if not uri:
            for resource in resources.values():
                console.print(f"{resource.server}: {resource.uri}  {resource.name}", highlight=False, markup=False)
            if not resources:
                console.print("the MCP servers offer no resources", highlight=False)
            return
        if uri not in resources:
            raise InvalidInput(f"no MCP resource {uri!r}", hint="/resource lists them")
        text = resource_text(self.toolbox, resources[uri])
        self.attached.append((uri, text))
        console.print(f"Attached {uri} to the next message ({len(text)} characters)", highlight=False, markup=False)

    def attach_resources(self, conversation: Conversation) -> None:
        """The attached resources go in front of the question, as files attached in the web page do."""
        if not self.attached or not conversation.messages or conversation.messages[-1].role != "user":
            return
        question = conversation.messages[-1]
        conversation.messages[-1] = question.model_copy(
            update={"content": with_resources(question.content, self.attached)}
        )
        self.attached = []

    @staticmethod
    def _note(text: str) -> None:
        console.print(f"[yellow]note:[/] {text}", highlight=False)


def no_tools_message() -> str:
    return "no MCP servers are configured; add one with `localllm mcp add` (see `localllm mcp --help`)"


@contextmanager
def open_chat_tools(
    client: Client, config_file: Path | None, *, trust: bool, enabled: bool
) -> Iterator[ChatTools | None]:
    """The chat's tools from mcp.json (none when it names no server, or with --no-tools); servers start on first
    use and stop when the chat ends."""
    with open_toolbox(config_file, trust_all=trust, enabled=enabled) as toolbox:
        yield ChatTools(client, toolbox) if toolbox is not None else None
