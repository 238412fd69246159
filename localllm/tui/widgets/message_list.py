"""The conversation: one markdown widget per message, scrolled to follow the answer being written."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown


class MessageView(Markdown):
    """One message; the role is a CSS class (user, assistant, error) styled in localllm.tcss."""


class MessageList(VerticalScroll):
    def on_mount(self) -> None:
        self.anchor()  # stay at the bottom while an answer grows, unless the user scrolls up

    def add_message(self, role: str, text: str = "") -> MessageView:
        view = MessageView(text, classes=role)
        self.mount(view)
        return view

    def clear_messages(self) -> None:
        self.remove_children()

    def last_answer(self) -> str:
        """The source of the newest assistant message ("" when there is none)."""
        answers = self.query(MessageView).filter(".assistant")
        return answers.last().source if answers else ""
