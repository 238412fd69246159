"""`localllm` command line. Each module registers the commands of one area on the shared app."""

from __future__ import annotations

import sys

from . import bench, chat, launch, mcp, models, others, plan, serve, worker  # noqa: E402,F401  (registration by import)
from .app import app


def main() -> None:
    from .interrupts import note_interrupts

    note_interrupts()
    sys.argv[1:] = bare_think(sys.argv[1:])
    app(prog_name="localllm")


def bare_think(argv: list[str]) -> list[str]:
    """Ollama's `run --think` takes an optional level (`--think=high`); a click option needs a value, so a bare
    `--think` is read as `--think=true`, as Ollama reads it."""
    end = argv.index("--") if "--" in argv else len(argv)
    return ["--think=true" if arg == "--think" else arg for arg in argv[:end]] + argv[end:]
