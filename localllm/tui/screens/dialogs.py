"""Modal dialogs: editing the system prompt and parameters, and confirming a deletion. Each returns its answer
through `dismiss`, so the screen that opened it decides what to do."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, TextArea

from ...conversation import parse_parameter
from ...errors import InvalidInput


@dataclass(frozen=True)
class Settings:
    """The part of a conversation the settings dialog edits."""

    system: str | None
    options: dict[str, Any]


def format_options(options: dict[str, Any]) -> str:
    """One `name value` line per option, the way the dialog shows and reads them."""
    return "\n".join(
        f"{name} {' '.join(map(str, value)) if isinstance(value, list) else value}" for name, value in options.items()
    )


def parse_options(text: str) -> dict[str, Any]:
    """Read `name value` lines (blank lines and #comments skipped); a bad line is an InvalidInput naming it."""
    options: dict[str, Any] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        try:
            options[words[0]] = parse_parameter(words[0], words[1:])
        except InvalidInput as exc:
            raise InvalidInput(f"line {number}: {exc.message}", hint=exc.hint) from None
    return options


def options_from_show(parameters: str) -> dict[str, Any]:
    """The options in `show`'s parameters text (`name value` lines, strings JSON-quoted, one line per stop);
    a line that does not read back is left out rather than shown wrong."""
    options: dict[str, Any] = {}
    for line in parameters.splitlines():
        name, _, raw = line.strip().partition(" ")
        raw = raw.strip()
        try:
            value = json.loads(raw) if raw.startswith('"') else raw
            typed = parse_parameter(name, [str(value)])
        except (ValueError, InvalidInput):
            continue
        options[name] = options.get(name, []) + typed if name == "stop" else typed
    return options


class SettingsScreen(ModalScreen[Settings | None]):
    """System prompt and parameters of the chat; Ctrl+S saves, Escape cancels."""

    BINDINGS = [Binding("ctrl+s", "save", "Save"), Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: Settings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(id="settings", classes="dialog"):
            yield Label("System prompt", classes="dialog-title")
            yield TextArea(self.settings.system or "", id="system", soft_wrap=True)
            yield Label("Parameters, one per line: name value (e.g. temperature 0)", classes="dialog-title")
            yield TextArea(format_options(self.settings.options), id="parameters")
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            options = parse_options(self.query_one("#parameters", TextArea).text)
        except InvalidInput as exc:
            self.notify(str(exc), title="Parameters", severity="error", markup=False)
            return
        system = self.query_one("#system", TextArea).text.strip() or None
        self.dismiss(Settings(system=system, options=options))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; y or Enter on Yes confirms, n or Escape declines."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm", classes="dialog"):
            yield Label(self.question, classes="dialog-title")
            with Horizontal(classes="buttons"):
                yield Button("Yes", id="yes", variant="error")
                yield Button("No", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # the safe answer is the default

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
