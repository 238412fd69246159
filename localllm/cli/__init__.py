"""`localllm` command line. Each module registers the commands of one area on the shared app."""

from __future__ import annotations

from .app import app
from . import models, chat, serve, bench, plan, worker  # noqa: E402,F401  (registration by import)


def main() -> None:
    app()
