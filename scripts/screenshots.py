"""Regenerate the pictures in docs/: the TUI's chat and models screens (Textual's own SVG export) and a terminal chat
session (the real REPL and model; only the typed lines are scripted, and rich records what the chat prints).

Dev-only, never imported by localllm. Needs a LOCALLLM_HOME that holds smollm2:135m:

    LOCALLLM_HOME=~/.cache/localllm-tests/home .venv/bin/python scripts/screenshots.py
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

DOCS = Path(__file__).resolve().parent.parent / "docs"
MODEL = "smollm2:135m"
SYSTEM = "You are a helpful AI assistant."
OPTIONS = {"temperature": 0, "num_predict": 160}
QUESTION = "Give me three tips for writing readable Python code."


# ---------------------------------------------------------------------------------------------------------- TUI


async def save_tui(client) -> None:
    from textual.widgets import TextArea

    from localllm.tui.app import LocalLLMApp

    app = LocalLLMApp(client, model=MODEL, system=SYSTEM, options=OPTIONS)
    async with app.run_test(size=(110, 34)) as pilot:
        for area in app.screen.query(TextArea):
            area.cursor_blink = False
        await pilot.press(*["space" if c == " " else c for c in QUESTION])
        await pilot.press("enter")
        while app.screen._answering:
            await pilot.pause(0.2)
        await app.workers.wait_for_complete()
        await pilot.pause(0.5)
        app.save_screenshot(str(DOCS / "tui.svg"))
        await pilot.press("f2")
        await app.workers.wait_for_complete()
        await pilot.pause(0.5)
        app.save_screenshot(str(DOCS / "tui-models.svg"))


# ---------------------------------------------------------------------------------------------------------- run

SESSION = [
    f"/set system {SYSTEM}",
    "/set parameter temperature 0",
    "/set parameter num_predict 200",
    "What is the capital of France?",
    QUESTION,
    "/stats",
    "/bye",
]


def save_session(client) -> None:
    """Run the REPL on a recording console, typing the SESSION lines; save what it printed as an SVG."""
    from localllm.cli import repl
    from localllm.conversation import Conversation

    record = Console(
        file=io.StringIO(),
        record=True,
        width=100,
        color_system="truecolor",
        force_terminal=True,
        force_interactive=False,
    )
    repl.console = record
    lines = _typed(record, iter(SESSION))
    record.print(f"$ localllm run {MODEL}", style="bold", highlight=False)
    repl.Repl(client, Conversation(MODEL), read_line=lambda prompt: next(lines)(prompt)).run()
    record.save_svg(str(DOCS / "run-session.svg"), title=f"localllm run {MODEL}")


def _typed(record: Console, lines: Iterator[str]):
    """Each call echoes the prompt and the next scripted line, as the terminal would show them."""
    for line in lines:

        def echo(prompt: str, line: str = line) -> str:
            record.print(f"[bold]{prompt}[/]{line}", highlight=False)
            return line

        yield echo


def main() -> None:
    from localllm.client.local import LocalClient

    DOCS.mkdir(exist_ok=True)
    client = LocalClient()
    try:
        asyncio.run(save_tui(client))
        save_session(client)
    finally:
        client.close()
    print(f"wrote {DOCS / 'tui.svg'}, {DOCS / 'tui-models.svg'}, {DOCS / 'run-session.svg'}")


if __name__ == "__main__":
    main()
