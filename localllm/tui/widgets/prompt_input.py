"""The message box: Enter sends, Ctrl-J (or Shift-Enter where the terminal tells them apart) starts a new line, and
pasted text keeps its newlines."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    BINDINGS = [
        Binding("enter", "submit", "Send", priority=True),
        Binding("ctrl+j,shift+enter", "newline", "New line", show=False, priority=True),
    ]

    @dataclass
    class Submitted(Message):
        """The user sent a message."""

        text: str

    def __init__(self, **kwargs) -> None:
        super().__init__(
            placeholder="Send a message (Enter sends, Ctrl+J new line)",
            soft_wrap=True,
            show_line_numbers=False,
            highlight_cursor_line=False,
            **kwargs,
        )

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(text))
            self.clear()

    def action_newline(self) -> None:
        self.insert("\n")
