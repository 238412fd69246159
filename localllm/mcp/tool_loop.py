"""The one tool loop the chats share (terminal chat, TUI, web page's server side): offer the enabled MCP servers'
tools to a model that can call tools, run each call the model makes after the surface's confirmation, give the
result back, and ask again, until the model answers without a call or the step limit is reached.

It talks to the model only through the Client Protocol, so it runs beside a chat, never inside the server's request
path. A surface implements `ToolLoopView`: where text goes, how a call is shown, how the user confirms. A tool's
failure, a timeout or a server that died becomes a tool error the model reads and the user sees; the chat goes on."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from .. import api, config
from ..client.protocol import Client
from ..conversation import Conversation
from .config import ServerEntry, load_config
from .sessions import McpError, McpSessions, McpTool

Decision = Literal["yes", "no", "always"]

MAX_STEPS = 8  # model turns in one answer that may call tools
MAX_RESULT_CHARS = 20_000  # of one tool's result given to the model (a small model's context is a few thousand tokens)
DECLINED = "The user declined to run this tool call. Do not call it again; answer without it."
STOPPED = "The user stopped this tool call before it finished."


@dataclass(frozen=True)
class PendingCall:
    """A call the model asked for: which server and tool, with which arguments (the protocol's JSON)."""

    server: str
    tool: str
    arguments: dict
    offered_name: str  # the function name the model used

    def describe(self) -> str:
        return f"{self.server}/{self.tool}({json.dumps(self.arguments, ensure_ascii=False)})"


@dataclass(frozen=True)
class CallOutcome:
    """What went back to the model for a call, and how it went: ok, error (the tool or its server failed), declined
    or truncated (ok, cut to the size limit)."""

    text: str
    status: Literal["ok", "error", "declined"]
    truncated: bool = False


class ToolLoopView(Protocol):
    """What a chat surface does for the loop."""

    def text(self, piece: str) -> None:
        """A piece of the model's answer."""

    def thinking(self, piece: str) -> None:
        """A piece of the model's thinking."""

    def note(self, text: str) -> None:
        """Something the user should know (a model without tools, a server that did not start, the step limit)."""

    def calling(self, call: PendingCall) -> None:
        """The model asked for `call` (shown before the confirmation, whether or not one is asked)."""

    def confirm(self, call: PendingCall) -> Decision:
        """Ask the user: run it (yes), not (no), or run this tool from now on without asking (always)."""

    def result(self, call: PendingCall, outcome: CallOutcome) -> None:
        """The call ran, failed or was declined."""

    def cancelled(self) -> bool:
        """Whether the user stopped the answer by other means than Ctrl-C (a TUI's Escape): a running tool is then
        cancelled as Ctrl-C cancels it."""


class Toolbox:
    """The MCP servers of one chat session: which are on, their tools under the names the model sees, and which
    run without asking (a trusted server, the trust flag, or "always" for a tool)."""

    def __init__(self, sessions: McpSessions, *, trust_all: bool = False):
        self.sessions = sessions
        self.trust_all = trust_all
        self.enabled = {name: True for name in sessions.entries}
        self._always: set[tuple[str, str]] = set()
        self._failed: dict[str, str] = {}  # servers that did not start this session, with why

    @property
    def entries(self) -> list[ServerEntry]:
        return list(self.sessions.entries.values())

    def set_enabled(self, server: str, enabled: bool) -> None:
        if server not in self.enabled:
            raise McpError(f"no MCP server named {server!r}", hint=f"configured: {', '.join(self.enabled) or 'none'}")
        self.enabled[server] = enabled
        if enabled:
            self._failed.pop(server, None)  # turned on again: try to start it again

    def offered(self, on_note: Callable[[str], None]) -> dict[str, McpTool]:
        """The tools of the enabled servers by the name the model sees: the tool's own name, or server__tool when
        two servers offer a tool of that name. A server that will not start is said once and left out."""
        tools: list[McpTool] = []
        for server, on in self.enabled.items():
            if not on or server in self._failed:
                continue
            try:
                tools += self.sessions.tools(server)
            except McpError as exc:
                self._failed[server] = str(exc)
                on_note(f"MCP server {server!r} is left out: {exc}")
        counts: dict[str, int] = {}
        for tool in tools:
            counts[tool.name] = counts.get(tool.name, 0) + 1
        return {(tool.name if counts[tool.name] == 1 else f"{tool.server}__{tool.name}"): tool for tool in tools}

    def needs_confirmation(self, call: PendingCall) -> bool:
        entry = self.sessions.entries[call.server]
        return not (self.trust_all or entry.trust or (call.server, call.tool) in self._always)

    def always(self, call: PendingCall) -> None:
        self._always.add((call.server, call.tool))

    def timeout(self, server: str) -> float:
        return self.sessions.entries[server].timeout

    def close(self) -> None:
        self.sessions.close()


@contextmanager
def open_toolbox(
    path: Path | None = None, *, trust_all: bool = False, enabled: bool = True
) -> Iterator[Toolbox | None]:
    """The toolbox of mcp.json's enabled servers (none start until a model can use them), or None when it names
    none or tools are off (`enabled` False, as --no-tools asks)."""
    entries = load_config(path).enabled() if enabled else []
    if not entries:
        yield None
        return
    toolbox = Toolbox(McpSessions(entries, log_dir=config.HOME.get() / "logs"), trust_all=trust_all)
    try:
        yield toolbox
    finally:
        toolbox.close()


@dataclass
class _Reply:
    """One model turn as streamed: its text, thinking, the calls it made and its last chunk."""

    content: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: list[api.ToolCall] = field(default_factory=list)
    final: api.ChatChunk | None = None


class ToolLoop:
    """Answers a conversation's last question, calling tools on the way. Holds no state of its own but which models
    can call tools (asked once per model)."""

    def __init__(self, client: Client, toolbox: Toolbox, *, max_steps: int = MAX_STEPS):
        self.client = client
        self.toolbox = toolbox
        self.max_steps = max_steps
        self._capable: dict[str, bool] = {}

    def answer(self, conversation: Conversation, view: ToolLoopView) -> api.ChatChunk | None:
        """Stream the answer to the conversation's last message, running the tools it calls, and record every
        message of the turn in the conversation. Ctrl-C (KeyboardInterrupt) stops the answer or the running tool:
        what was said is kept, and a stopped call is recorded as stopped, so the history stays well formed."""
        tools = self._tools(conversation.model, view)
        made: set[str] = set()
        must_answer = False
        for step in range(self.max_steps):
            # The last turn is offered no tools: it must answer from the results it has.
            must_answer = must_answer or step == self.max_steps - 1
            offered = [] if must_answer else [_as_api_tool(name, tool) for name, tool in tools.items()]
            reply = self._stream(conversation, offered, view, first=step == 0)
            if reply.calls and {_call_key(call) for call in reply.calls} <= made:
                # Only calls already answered above (small models loop so): that turn is dropped and the model is
                # asked again, with no tools, for the answer.
                must_answer = True
                continue
            if not reply.calls:
                conversation.answered("".join(reply.content), reply.final, thinking="".join(reply.thinking))
                return reply.final
            self._record_calls(conversation, reply)
            for call in reply.calls:
                made.add(_call_key(call))
                self._run(conversation, tools, call, view)
        view.note(f"stopped after {self.max_steps} model turns that called tools")
        return None

    # ----------------------------------------------------------------------------------------------- steps

    def _tools(self, model: str, view: ToolLoopView) -> dict[str, McpTool]:
        """The tools to offer this model: none, with a note saying so, when its template cannot show tools."""
        if model not in self._capable:
            self._capable[model] = "tools" in self.client.show(model).capabilities
            if not self._capable[model]:
                view.note(f"{model} cannot call tools (its template has no tools), so MCP tools are not offered")
        if not self._capable[model]:
            return {}
        return self.toolbox.offered(view.note)

    def _stream(self, conversation: Conversation, tools: list[api.Tool], view: ToolLoopView, *, first: bool) -> _Reply:
        request = conversation.request().model_copy(update={"tools": tools or None})
        reply = _Reply()
        stream = self.client.chat(request)
        try:
            for chunk in stream:
                self._take(chunk, reply, view)
        except KeyboardInterrupt:
            _keep_interrupted(conversation, reply, first=first)
            raise
        finally:
            stream.close()
        return reply

    @staticmethod
    def _take(chunk: api.ChatChunk, reply: _Reply, view: ToolLoopView) -> None:
        message = chunk.message
        if message.thinking:
            reply.thinking.append(message.thinking)
            view.thinking(message.thinking)
        if message.content:
            reply.content.append(message.content)
            view.text(message.content)
        reply.calls += message.tool_calls or []
        if chunk.done:
            reply.final = chunk

    @staticmethod
    def _record_calls(conversation: Conversation, reply: _Reply) -> None:
        conversation.messages.append(
            api.Message(
                role="assistant",
                content="".join(reply.content),
                thinking="".join(reply.thinking) or None,
                tool_calls=reply.calls,
            )
        )
        if reply.final is not None:
            conversation.figures.add(reply.final)

    def _run(
        self, conversation: Conversation, tools: dict[str, McpTool], call: api.ToolCall, view: ToolLoopView
    ) -> None:
        """Run one call (after asking) and record its result as the tool message the model reads next."""
        name = call.function.name
        tool = tools.get(name)
        pending = PendingCall(tool.server, tool.name, dict(call.function.arguments), name) if tool else None
        if pending is None:
            outcome = CallOutcome(f"Error: there is no tool named {name!r}; the tools are: {', '.join(tools)}", "error")
        else:
            view.calling(pending)
            try:
                outcome = self._confirmed_outcome(pending, view)
            except KeyboardInterrupt:
                conversation.messages.append(api.Message(role="tool", content=STOPPED, tool_name=name))
                raise
            view.result(pending, outcome)
        conversation.messages.append(api.Message(role="tool", content=outcome.text, tool_name=name))

    def _confirmed_outcome(self, call: PendingCall, view: ToolLoopView) -> CallOutcome:
        if self.toolbox.needs_confirmation(call):
            decision = view.confirm(call)
            if decision == "no":
                return CallOutcome(DECLINED, "declined")
            if decision == "always":
                self.toolbox.always(call)
        return run_call(self.toolbox, call, cancelled=view.cancelled)


def run_call(
    toolbox: Toolbox,
    call: PendingCall,
    *,
    max_chars: int = MAX_RESULT_CHARS,
    cancelled: Callable[[], bool] = lambda: False,
) -> CallOutcome:
    """Run a confirmed call: its result cut to `max_chars` (the cut said in the text), or its failure as an error
    text for the model. Ctrl-C propagates (the server is told to cancel)."""
    try:
        timeout = toolbox.timeout(call.server)
        result = toolbox.sessions.call(call.server, call.tool, call.arguments, timeout=timeout, cancelled=cancelled)
    except McpError as exc:
        return CallOutcome(f"Error: {exc}", "error")
    text, truncated = bound_text(result.text, max_chars)
    if result.is_error:
        return CallOutcome(f"Error: {text}", "error", truncated)
    return CallOutcome(text, "ok", truncated)


def bound_text(text: str, max_chars: int) -> tuple[str, bool]:
    """`text`, or its first `max_chars` characters with a line saying how much was cut."""
    if len(text) <= max_chars:
        return text, False
    return (
        text[:max_chars]
        + f"\n[truncated: the tool returned {len(text):,} characters; the first {max_chars:,} are shown]",
        True,
    )


def _call_key(call: api.ToolCall) -> str:
    return call.function.name + json.dumps(call.function.arguments, sort_keys=True)


def _as_api_tool(name: str, tool: McpTool) -> api.Tool:
    schema = tool.input_schema or {"type": "object", "properties": {}}
    return api.Tool(function=api.ToolFunction(name=name, description=tool.description, parameters=schema))


def _keep_interrupted(conversation: Conversation, reply: _Reply, *, first: bool) -> None:
    """An answer stopped by Ctrl-C: keep what it said; a question that got nothing at all goes, as in the chat."""
    if reply.content or reply.thinking:
        conversation.answered("".join(reply.content), thinking="".join(reply.thinking))
    elif first:
        conversation.withdraw()
