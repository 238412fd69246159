"""The conversation: one markdown widget per message, scrolled to follow the answer being written; a reasoning
model's thinking sits above its answer in a collapsible."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Collapsible, Markdown, Static


class ThinkingView(Collapsible):
    """The thinking of one answer: open while it streams, collapsed to its title once the answer begins (a click on
    the title opens it again)."""

    def __init__(self) -> None:
        self.text = ""
        self._body = Static(classes="thinking-text")
        super().__init__(self._body, title="Thinking…", collapsed=False, classes="thinking")

    def add(self, text: str) -> None:
        self.text += text
        self._body.update(Text(self.text.strip()))

    def finish(self) -> None:
        if self.title != "Thinking":
            self.title = "Thinking"
            self.collapsed = True


class MessageView(Markdown):
    """One message; the role is a CSS class (user, assistant, error) styled in localllm.tcss."""

    thinking: ThinkingView | None = None


class MessageList(VerticalScroll):
    def on_mount(self) -> None:
        self.anchor()  # stay at the bottom while an answer grows, unless the user scrolls up

    def add_message(self, role: str, text: str = "") -> MessageView:
        view = MessageView(text, classes=role)
        self.mount(view)
        return view

    def add_thinking(self, reply: MessageView) -> ThinkingView:
        """The collapsible for the thinking of `reply`, above it."""
        view = ThinkingView()
        self.mount(view, before=reply)
        reply.thinking = view
        return view

    def clear_messages(self) -> None:
        self.remove_children()

    def last_answer(self) -> str:
        """The source of the newest assistant message ("" when there is none)."""
        answers = self.query(MessageView).filter(".assistant")
        return answers.last().source if answers else ""
