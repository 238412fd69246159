"""The TUI application: a thin App that holds a Client, opens the chat screen, and turns errors into notifications
(logged with their cause). Screens do the routing, widgets the drawing; all styles are in localllm.tcss."""

from __future__ import annotations

import logging
from typing import Any

from textual.app import App
from textual.binding import Binding

from ..client.protocol import Client
from ..conversation import Conversation
from ..errors import LocalLLMError
from ..mcp.tool_loop import Toolbox
from .messages import ErrorReported
from .screens.chat import ChatScreen

log = logging.getLogger(__name__)


class LocalLLMApp(App[None]):
    CSS_PATH = "localllm.tcss"
    TITLE = "localllm"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(
        self,
        client: Client,
        *,
        model: str | None = None,
        system: str | None = None,
        options: dict[str, Any] | None = None,
        notice: LocalLLMError | None = None,
        tools: Toolbox | None = None,
    ):
        """
        Args:
            client: where models live: an HttpClient (the usual case) or a LocalClient.
            model: the model to chat with at start; None opens the chat with no model (F2 picks one).
            system, options: the chat's system prompt and parameters at start.
            notice: an error from before the app started (e.g. the server did not start), shown at once.
            tools: the MCP servers whose tools the chat offers (mcp/tool_loop.py), or None.
        """
        super().__init__()
        self.client = client
        self.conversation = Conversation(model or "", system=system, options=dict(options or {}))
        self._notice = notice
        self._tools = tools

    def on_mount(self) -> None:
        self.push_screen(ChatScreen(self.client, self.conversation, self._tools))
        if self._notice is not None:
            self.report(self._notice, title="Server")

    def on_error_reported(self, message: ErrorReported) -> None:
        self.report(message.error, title=message.title)

    def report(self, error: BaseException, *, title: str) -> None:
        """Show an error as a notification and log it with its cause (the traceback goes to the log)."""
        log.error("%s: %s", title, error, exc_info=error)
        self.notify(str(error), title=title, severity="error", timeout=12, markup=False)
