"""The chat screen: the conversation, the message box and the engine panel.

Answers stream in a thread worker that feeds the reply's `Markdown.get_stream()`; when it ends it posts
`AnswerFinished` and the screen records the answer. The engine panel is refreshed from `client.ps()` by a polling
worker; a server that stops answering is said once, as a notification."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Markdown
from textual.worker import get_current_worker

from ... import api
from ...client.protocol import Client
from ...conversation import Conversation, is_model, rate
from ...errors import LocalLLMError
from ...mcp.prompts import with_resources
from ...mcp.tool_loop import Toolbox, ToolLoop
from ..messages import ErrorReported
from ..widgets.engine_panel import EnginePanel
from ..widgets.message_list import MessageList, MessageView
from ..widgets.prompt_input import PromptInput
from .dialogs import Settings, SettingsScreen, options_from_show
from .mcp_commands import McpCommands, is_mcp_command
from .models import ModelsScreen

if TYPE_CHECKING:
    from textual.widgets._markdown import MarkdownStream


POLL_SECONDS = 2.0
STOPPED_MARK = "\n\n*(stopped)*"


class ChatScreen(Screen):
    BINDINGS = [
        Binding("f2", "models", "Models"),
        Binding("f3", "settings", "System & parameters"),
        Binding("escape", "stop", "Stop answer"),
        Binding("ctrl+l", "clear", "Clear chat"),
    ]

    @dataclass
    class AnswerFinished(Message):
        """An answer ended: completely (timings set), stopped by the user, or by an error."""

        text: str
        timings: api.Timings | None
        error: LocalLLMError | None
        epoch: int  # the chat it belongs to: an answer stopped by /clear or a model switch is not recorded
        thinking: str = ""

    def __init__(self, client: Client, conversation: Conversation, tools: Toolbox | None = None):
        super().__init__()
        self.client = client
        self.conversation = conversation
        self.tool_loop = ToolLoop(client, tools) if tools is not None else None  # MCP tools (screens/tools.py)
        self.mcp_commands = McpCommands(tools) if tools is not None else None  # /prompt, /resource
        self._server_up: bool | None = None
        self._answering = False
        self._epoch = 0

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield MessageList(id="messages")
                yield PromptInput(id="prompt")
            yield EnginePanel(id="engine")
        yield Footer()

    def on_mount(self) -> None:
        self._show_model()
        self.query_one(PromptInput).focus()
        self.poll_engine()
        self.set_interval(POLL_SECONDS, self.poll_engine)

    # ----------------------------------------------------------------------------------------------- sending

    @on(PromptInput.Submitted)
    def submitted(self, event: PromptInput.Submitted) -> None:
        if is_mcp_command(event.text):
            self.mcp_command(event.text)
        else:
            self.send(event.text)

    def send(self, text: str) -> None:
        if not self.conversation.model:
            self.notify("Pick a model first: press F2.", severity="warning")
            return
        if self._answering:
            self.notify("An answer is still being written: wait, or press Escape to stop it.", severity="warning")
            return
        messages = self.query_one(MessageList)
        attached = self.mcp_commands.take_attached() if self.mcp_commands is not None else []
        shown = "".join(f"*(attached {uri})*\n\n" for uri, _ in attached) + text
        messages.add_message("user", shown)
        reply = messages.add_message("assistant")
        self._answering = True
        request = self.conversation.ask(with_resources(text, attached))
        if self.tool_loop is not None:
            self.answer_with_tools(reply)
            return
        self.stream_answer(request, reply, self._epoch)

    @work(thread=True, exclusive=True, group="mcp")
    def mcp_command(self, line: str) -> None:
        """/prompt or /resource (screens/mcp_commands.py), in a thread: a server may have to start first."""
        if self.mcp_commands is None:
            self.app.call_from_thread(self.notify, "No MCP servers are configured (see `localllm mcp --help`).")
            return
        try:
            result = self.mcp_commands.run(line, lambda text: self.app.call_from_thread(self._note, text))
        except LocalLLMError as exc:
            self.post_message(ErrorReported(exc, title=line.split()[0]))
            return
        if result.said:
            self.app.call_from_thread(self.notify, result.said, title="MCP", timeout=12, markup=False)
        if result.send is not None:
            self.app.call_from_thread(self.send, result.send)

    def _note(self, text: str) -> None:
        self.notify(text, title="MCP", severity="warning", markup=False)

    @work(thread=True, exclusive=True, group="answer")
    def stream_answer(self, request: api.ChatRequest, reply: MessageView, epoch: int) -> None:
        """Runs in a thread: chunks go to the reply's markdown stream; closing the chunk iterator cancels."""
        worker = get_current_worker()
        markdown: MarkdownStream = self.app.call_from_thread(Markdown.get_stream, reply)
        parts: list[str] = []
        final, error = None, None
        chunks = self.client.chat(request)
        tokens, started = 0, 0.0
        try:
            for chunk in chunks:
                if worker.is_cancelled:
                    break
                started = started or time.perf_counter()
                tokens += len(chunk.tokens or ()) or 1
                parts.append(chunk.message.content)
                if chunk.message.thinking:
                    self.app.call_from_thread(self._show_thinking, reply, chunk.message.thinking)
                self.app.call_from_thread(
                    _awaited(self._show_piece), markdown, chunk.message.content, _live_rate(tokens, started), reply
                )
                if chunk.done:
                    final = chunk
        except LocalLLMError as exc:
            error = exc
        finally:
            chunks.close()
            self.app.call_from_thread(_awaited(markdown.stop))
            if reply.thinking is not None:
                self.app.call_from_thread(reply.thinking.finish)
        if final is None and error is None:  # stopped (Escape): said on the answer, as the terminal chat does
            self.app.call_from_thread(reply.append, STOPPED_MARK)
        thinking = reply.thinking.text if reply.thinking is not None else ""
        self.post_message(self.AnswerFinished("".join(parts), final, error, epoch, thinking))

    @work(thread=True, exclusive=True, group="answer")
    def answer_with_tools(self, reply: MessageView) -> None:
        """As stream_answer, through the MCP tool loop, which records the turn in the conversation itself."""
        from .tools import TuiToolView

        assert self.tool_loop is not None
        view = TuiToolView(self, get_current_worker(), reply)
        error = None
        try:
            self.tool_loop.answer(self.conversation, view)
        except KeyboardInterrupt:  # Escape: the loop kept what was said and how far the calls went
            view.close()
            self.app.call_from_thread(_awaited(view.reply.append), STOPPED_MARK)
        except LocalLLMError as exc:
            error = exc
        view.close()
        self.app.call_from_thread(self._tools_finished, error)

    def _tools_finished(self, error: LocalLLMError | None) -> None:
        self._answering = False
        if error is not None:
            self.post_message(ErrorReported(error, title="Answer failed"))
        self._show_answer_figures()
        self.poll_engine()

    def _show_thinking(self, reply: MessageView, text: str) -> None:
        view = reply.thinking or self.query_one(MessageList).add_thinking(reply)
        view.add(text)

    async def _show_piece(self, markdown: MarkdownStream, text: str, speed: float | None, reply: MessageView) -> None:
        if text and reply.thinking is not None:
            reply.thinking.finish()  # the answer has begun: the thinking folds away above it
        await markdown.write(text)
        panel = self.query_one(EnginePanel)
        panel.figures = replace(panel.figures, live_rate=speed)

    @on(AnswerFinished)
    def record_answer(self, event: AnswerFinished) -> None:
        self._answering = False
        if event.epoch != self._epoch:
            return
        if event.error is not None and not event.text:
            self.conversation.withdraw()
        else:
            self.conversation.answered(event.text, event.timings, thinking=event.thinking)
        if event.error is not None:
            self.post_message(ErrorReported(event.error, title="Answer failed"))
        self._show_answer_figures()
        self.poll_engine()

    def _show_answer_figures(self) -> None:
        f = self.conversation.figures
        last = f.last
        panel = self.query_one(EnginePanel)
        panel.figures = replace(
            panel.figures,
            live_rate=None,
            last_rate=rate(last.eval_count, last.eval_duration) if last else None,
            prompt_tokens=f.prompt_tokens,
            cached_tokens=f.cached_tokens,
            drafted=f.drafted,
            accepted=f.accepted,
        )

    # ----------------------------------------------------------------------------------------------- engine panel

    @work(thread=True, exclusive=True, group="poll")
    def poll_engine(self) -> None:
        try:
            processes = self.client.ps()
        except LocalLLMError as exc:
            self.app.call_from_thread(self._server_state, exc)
            return
        self.app.call_from_thread(self._server_state, None)
        self.app.call_from_thread(self._show_process, processes)

    def _server_state(self, error: LocalLLMError | None) -> None:
        up = error is None
        if up != self._server_up and error is not None:
            self.post_message(ErrorReported(error, title="Server unreachable"))
        self._server_up = up
        for panel in self._engine_panel():
            panel.figures = replace(panel.figures, server="connected" if up else "unreachable")

    def _show_process(self, processes: api.ProcessResponse) -> None:
        model = self.conversation.model
        process = next((p for p in processes.models if is_model(p, model)), None)
        for panel in self._engine_panel():
            panel.figures = replace(panel.figures, model=model, process=process)

    def _engine_panel(self) -> list[EnginePanel]:
        """The panel, or none once the screen is taken down: a poll's answer can arrive after it."""
        return list(self.query(EnginePanel))

    # ----------------------------------------------------------------------------------------------- actions

    def action_stop(self) -> None:
        self.workers.cancel_group(self, "answer")

    def action_clear(self) -> None:
        self.action_stop()
        self._epoch += 1
        self.conversation.clear()
        self.query_one(MessageList).clear_messages()

    def action_models(self) -> None:
        self.app.push_screen(ModelsScreen(self.client, current=self.conversation.model), callback=self.use_model)

    def use_model(self, model: str | None) -> None:
        if not model or model == self.conversation.model:
            return
        self.action_clear()
        self.conversation.switch_model(model)
        self._show_model()
        self.notify(f"Chatting with {model}.", markup=False)
        self.poll_engine()

    @work(thread=True, exclusive=True, group="settings")
    def action_settings(self) -> None:
        """Open the dialog with what applies now: the chat's own settings over the model's SYSTEM and parameters."""
        system, options = self.conversation.system, dict(self.conversation.options)
        if self.conversation.model:
            try:
                info = self.client.show(self.conversation.model)
            except LocalLLMError as exc:
                self.app.call_from_thread(self.app.report, exc, title="Model settings")  # type: ignore[attr-defined]
            else:
                system = system if system is not None else (info.system or None)
                options = {**options_from_show(info.parameters), **options}
        self.app.call_from_thread(
            self.app.push_screen, SettingsScreen(Settings(system=system, options=options)), self.apply_settings
        )

    def apply_settings(self, settings: Settings | None) -> None:
        if settings is None:
            return
        self.conversation.system = settings.system
        self.conversation.options = dict(settings.options)
        self.notify("System prompt and parameters saved.")

    def _show_model(self) -> None:
        self.sub_title = self.conversation.model or "no model: press F2"
        panel = self.query_one(EnginePanel)
        panel.figures = replace(panel.figures, model=self.conversation.model)


def _live_rate(tokens: int, started: float) -> float | None:
    # The first token's time is prompt evaluation, so the rate counts from it: (tokens after it) / (time since).
    elapsed = time.perf_counter() - started
    return (tokens - 1) / elapsed if tokens > 1 and elapsed > 0 else None


def _awaited(coroutine_function: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[Any]]:
    """A coroutine function as App.call_from_thread's annotation accepts it (its return type is inferred as Never
    for a coroutine that returns None)."""
    return coroutine_function
