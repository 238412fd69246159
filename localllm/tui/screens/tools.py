"""MCP tools in the TUI: the confirm dialog (yes / no / always for this tool) and the tool loop's view, which runs in
the chat's answer worker and draws on the screen through `call_from_thread`. Each call is a card in the message list
(server › tool and its arguments), filled in with its result, refusal or error."""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Markdown

from ...mcp.tool_loop import CallOutcome, Decision, PendingCall
from ..widgets.message_list import MessageList, MessageView

if TYPE_CHECKING:
    from textual.screen import Screen
    from textual.widgets._markdown import MarkdownStream
    from textual.worker import Worker

SHOWN_RESULT_CHARS = 600  # of a result, on its card (the model gets up to the loop's bound)


class ToolConfirmScreen(ModalScreen[Decision]):
    """Run this call? Yes, no, or always for this tool (this chat)."""

    BINDINGS = [
        Binding("y", "answer('yes')", "Yes"),
        Binding("n,escape", "answer('no')", "No"),
        Binding("a", "answer('always')", "Always"),
    ]

    def __init__(self, call: PendingCall):
        super().__init__()
        self.call = call

    def compose(self) -> ComposeResult:
        with Vertical(id="tool-confirm", classes="dialog"):
            yield Label(f"The model calls {self.call.server} › {self.call.tool}", classes="dialog-title", markup=False)
            yield Label(json.dumps(self.call.arguments, ensure_ascii=False, indent=2), markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", id="yes", variant="primary")
                yield Button("No (n)", id="no")
                yield Button("Always for this tool (a)", id="always")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter alone runs nothing

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.action_answer(str(event.button.id))

    def action_answer(self, decision: str) -> None:
        self.dismiss({"yes": "yes", "always": "always"}.get(decision, "no"))  # type: ignore[arg-type]


class TuiToolView:
    """The tool loop's view on the chat screen, called on the answer worker's thread. Escape (the worker cancelled)
    stops the loop as Ctrl-C does in the terminal: by KeyboardInterrupt, which the loop records and re-raises."""

    def __init__(self, screen: Screen, worker: Worker, reply: MessageView):
        self.screen = screen
        self.app = screen.app
        self.worker = worker
        self.reply = reply
        self._markdown: MarkdownStream | None = None
        self._card: MessageView | None = None

    def text(self, piece: str) -> None:
        self._check_stop()
        if self._markdown is None:
            self._markdown = self.app.call_from_thread(Markdown.get_stream, self.reply)
        self.app.call_from_thread(_awaited(self._markdown.write), piece)

    def thinking(self, piece: str) -> None:
        self._check_stop()

    def note(self, text: str) -> None:
        self.app.call_from_thread(self.screen.notify, text, title="Tools", severity="warning", markup=False)

    def calling(self, call: PendingCall) -> None:
        self._end_reply()
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        self._card = self.app.call_from_thread(self._add, "tool", f"**{call.server} › {call.tool}** `{arguments}`")

    def confirm(self, call: PendingCall) -> Decision:
        answered = threading.Event()
        decision: list[Decision] = []

        def take(value: Decision | None) -> None:
            decision.append(value or "no")
            answered.set()

        self.app.call_from_thread(self.app.push_screen, ToolConfirmScreen(call), take)
        while not answered.wait(0.1):
            self._check_stop()
        return decision[0]

    def result(self, call: PendingCall, outcome: CallOutcome) -> None:
        text = outcome.text if len(outcome.text) <= SHOWN_RESULT_CHARS else outcome.text[:SHOWN_RESULT_CHARS] + "…"
        label = {"ok": "result", "error": "tool error", "declined": "declined"}[outcome.status]
        cut = " (cut to the size limit)" if outcome.truncated else ""
        card = self._card
        if card is not None:
            self.app.call_from_thread(_awaited(card.append), f"\n\n*{label}{cut}:*\n\n```\n{text}\n```")
        self.reply = self.app.call_from_thread(self._add, "assistant", "")  # the answer goes on below the card

    def cancelled(self) -> bool:
        return self.worker.is_cancelled

    def close(self) -> None:
        self._end_reply()

    def _end_reply(self) -> None:
        if self._markdown is not None:
            self.app.call_from_thread(_awaited(self._markdown.stop))
            self._markdown = None

    def _add(self, role: str, text: str) -> MessageView:
        return self.screen.query_one(MessageList).add_message(role, text)

    def _check_stop(self) -> None:
        if self.worker.is_cancelled:
            raise KeyboardInterrupt


def _awaited(coroutine_function: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[Any]]:
    """A coroutine function as App.call_from_thread's annotation accepts it (as in chat.py)."""
    return coroutine_function
