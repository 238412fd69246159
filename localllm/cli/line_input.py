"""The chat's line input: a prompt_toolkit editor with a persistent history, multi-line messages between \"\"\"
(Ollama's), and the terminal handling that keeps a Ctrl-C typed ahead meant for the answer it interrupts."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from .interrupts import interrupt_handled

PROMPT = ">>> "
CONTINUATION = "... "
PLACEHOLDER = "Send a message (/? for help)"
TRIPLE_QUOTE = '"""'

ReadLine = Callable[[str], str]


class LineInput(Protocol):
    """What the chat reads its lines with (LineReader)."""

    def __call__(self, prompt: str) -> str: ...

    def take_interrupt(self) -> bool: ...

    def keep_history(self, enabled: bool) -> None: ...


class LineReader:
    """A prompt_toolkit line editor with a persistent history (up arrow, Ctrl-R) and bracketed paste, so pasted
    text with newlines arrives as one message.

    Ctrl-C pressed right after Enter, before the editor has handed the terminal back, reaches the editor as a key
    rather than as a signal (the terminal is still raw): it would stop nothing and show up at the next prompt.
    Such a Ctrl-C is taken out of the typed-ahead keys here and reported by `take_interrupt`, so the answer it was
    meant for is stopped instead."""

    def __init__(self, history_file: Path | None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.formatted_text import FormattedText
        from prompt_toolkit.history import InMemoryHistory

        if history_file is not None:
            history_file.parent.mkdir(parents=True, exist_ok=True)
        self._history = _switchable_history(str(history_file)) if history_file is not None else None
        self.session: PromptSession = PromptSession(
            history=self._history if self._history is not None else InMemoryHistory()
        )
        self._placeholder = FormattedText([("#808080", PLACEHOLDER)])
        self._interrupted = False

    def __call__(self, prompt: str) -> str:
        line = self.session.prompt(prompt, placeholder=self._placeholder if prompt == PROMPT else None)
        try:
            self._interrupted = self._interrupt_typed_ahead()
        except KeyboardInterrupt:  # the terminal is back in line mode: Ctrl-C is a signal again, meant for the answer
            interrupt_handled()
            self._interrupted = True
        return line

    def keep_history(self, enabled: bool) -> None:
        """/set history | nohistory: whether lines typed from now on are written to the history file."""
        if self._history is not None:
            self._history.saving = enabled

    def take_interrupt(self) -> bool:
        """Whether Ctrl-C came after the last line was entered, before signals could carry it (then forgotten)."""
        interrupted, self._interrupted = self._interrupted, False
        return interrupted

    def _interrupt_typed_ahead(self) -> bool:
        from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
        from prompt_toolkit.keys import Keys

        keys = get_typeahead(self.session.input) + _unread_keys()
        kept = [key for key in keys if key.key != Keys.ControlC]
        store_typeahead(self.session.input, kept)
        return len(kept) < len(keys)


def _switchable_history(path: str):
    """A history file that can stop being written (prompt_toolkit is imported only when the chat opens)."""
    from prompt_toolkit.history import FileHistory

    class SwitchableHistory(FileHistory):
        saving = True  # off: lines stay recallable in this chat but are not written

        def store_string(self, string: str) -> None:
            if self.saving:
                super().store_string(string)

    return SwitchableHistory(path)


def _unread_keys() -> list:
    """Keys typed while the editor was closing: still bytes in the terminal's queue, unseen as signals. The terminal
    is in line mode again here, so they are read with line mode briefly off (nothing waits: only what is there)."""
    import select

    if sys.platform == "win32" or not sys.stdin.isatty():
        return []
    import termios

    from prompt_toolkit.input.vt100_parser import Vt100Parser

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    raw = list(saved)
    raw[3] &= ~(termios.ICANON | termios.ECHO | termios.ISIG)
    raw[6] = list(saved[6])
    raw[6][termios.VMIN], raw[6][termios.VTIME] = 0, 0
    data = b""
    try:
        termios.tcsetattr(fd, termios.TCSANOW, raw)
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1024)
            if not chunk:
                break
            data += chunk
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
    keys: list = []
    parser = Vt100Parser(keys.append)
    parser.feed(data.decode("utf-8", "replace"))
    parser.flush()
    return keys


@contextmanager
def keys_not_echoed() -> Iterator[None]:
    """While an answer is drawn, keys typed (and the ^C of Ctrl-C) are not echoed; Ctrl-C still signals. An echo
    would move the cursor under the redrawn region, which then leaves its last line on screen twice."""
    if sys.platform == "win32" or not sys.stdin.isatty():
        yield
        return
    import termios

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def make_line_reader(history_file: Path | None) -> LineReader:
    return LineReader(history_file)


def read_message(read_line: ReadLine) -> str:
    """One message: a line, or the lines from an opening \"\"\" to the line that closes it (Ollama's multi-line)."""
    first = read_line(PROMPT)
    if first.count(TRIPLE_QUOTE) != 1:
        return first
    lines = [first]
    while TRIPLE_QUOTE not in lines[-1] or len(lines) == 1:
        lines.append(read_line(CONTINUATION))
    return "\n".join(lines)


def unquote(text: str) -> str:
    """Strip one pair of surrounding \"\"\" (or \") from a message or a /set system value."""
    text = text.strip()
    for quote in (TRIPLE_QUOTE, '"'):
        if len(text) >= 2 * len(quote) and text.startswith(quote) and text.endswith(quote):
            return text[len(quote) : -len(quote)].strip()
    if text.startswith(TRIPLE_QUOTE) or text.endswith(TRIPLE_QUOTE):
        return text.replace(TRIPLE_QUOTE, "").strip()
    return text
