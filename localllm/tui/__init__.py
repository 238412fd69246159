"""The terminal UI (`localllm tui`), built on textual: a client of the REST server like any other."""

from __future__ import annotations

import logging
from pathlib import Path

from ..client.protocol import Client
from ..errors import BackendUnavailable, LocalLLMError
from ..mcp.tool_loop import Toolbox


def run_tui(
    client: Client,
    *,
    model: str | None = None,
    notice: LocalLLMError | None = None,
    log_file: Path | None = None,
    tools: Toolbox | None = None,
) -> None:
    """Run the TUI until the user quits; errors it shows are also logged to `log_file` with their cause."""
    try:
        from .app import LocalLLMApp
    except ImportError as exc:
        raise BackendUnavailable(f"the TUI needs textual ({exc})", hint="pip install textual") from None
    if log_file is not None:
        _log_to(log_file)
    LocalLLMApp(client, model=model, notice=notice, tools=tools).run()


def _log_to(path: Path) -> None:
    # The screen belongs to the TUI, so log records go to a file rather than to stderr.
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    logger = logging.getLogger("localllm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
