"""Messages that screens send up to the app (attributes go down: screens are given the client and conversation)."""

from __future__ import annotations

from textual.message import Message


class ErrorReported(Message):
    """Something failed that the user should see: the app shows it as a notification and logs it with its cause.
    Safe to post from a worker thread."""

    def __init__(self, error: BaseException, *, title: str) -> None:
        super().__init__()
        self.error = error
        self.title = title
