"""Connections to the configured MCP servers, over the official SDK (stdio_client, streamable_http_client,
ClientSession), for the chats, which are synchronous.

The SDK is async and its context managers must be entered and left by one task, so the manager owns an event loop
on a thread of its own: each server is one task there that opens the transport and the session, then waits to be
told to stop; calls from the chat's thread are submitted to that loop and waited for with a time limit. A server
starts on first use and again after it died; its stderr goes to LOCALLLM_HOME/logs/mcp-<name>.log, never to the
terminal. Nothing here logs a server's env or headers."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

from ..errors import LocalLLMError
from .config import ServerEntry

T = TypeVar("T")

START_TIMEOUT = 60.0  # seconds for a server to start and list its tools (npx and uvx may install first)
STOP_TIMEOUT = 10.0
CANCEL_POLL = 0.1  # seconds between looks at a caller's cancel flag while a call runs


class McpError(LocalLLMError):
    """An MCP server that could not start, answered with a protocol error, died, or ran past its time limit."""

    status_code = 502


class McpTimeout(McpError):
    """A call that ran past its time limit (the server was told to cancel it)."""


@dataclass(frozen=True)
class McpTool:
    server: str
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class McpPrompt:
    server: str
    name: str
    description: str
    arguments: tuple[str, ...]  # their names, required ones first
    required: tuple[str, ...]


@dataclass(frozen=True)
class McpResource:
    server: str
    uri: str
    name: str
    description: str


@dataclass(frozen=True)
class ToolResult:
    """What a tool answered, as text for the model; `is_error` when the server said the call failed."""

    text: str
    is_error: bool = False


@dataclass
class _Connection:
    entry: ServerEntry
    stop: asyncio.Event
    session: Any = None  # mcp.ClientSession once started
    tools: list[McpTool] = field(default_factory=list)
    task: asyncio.Task | None = None
    alive: bool = False


class McpSessions:
    """The running servers of one chat (or one web server). Thread-safe; `close()` stops them all."""

    def __init__(self, entries: list[ServerEntry], *, log_dir: Path | None = None):
        self.entries = {entry.name: entry for entry in entries}
        self._log_dir = log_dir
        self._connections: dict[str, _Connection] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-sessions", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------------- sync API

    def tools(self, server: str) -> list[McpTool]:
        """The server's tools (it starts first if it is not running)."""
        return self._connection(server).tools

    def call(
        self,
        server: str,
        tool: str,
        arguments: dict[str, Any],
        *,
        timeout: float,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> ToolResult:
        """Run one tool with its arguments as the protocol's JSON. A server error, a crash or the time limit is an
        McpError; Ctrl-C, or `cancelled()` turning true (a TUI's Escape), cancels the call on the server and raises
        KeyboardInterrupt."""
        connection = self._connection(server)
        try:
            return self._wait(self._call(connection, tool, arguments, timeout), timeout + STOP_TIMEOUT, cancelled)
        except McpTimeout:
            raise
        except McpError:
            self._forget_if_dead(connection)
            raise

    def prompts(self, server: str) -> list[McpPrompt]:
        connection = self._connection(server)
        return self._wait(self._list_prompts(connection), START_TIMEOUT)

    def get_prompt(self, server: str, name: str, arguments: dict[str, str]) -> list[tuple[str, str]]:
        """The prompt's messages as (role, text)."""
        connection = self._connection(server)
        return self._wait(self._get_prompt(connection, name, arguments), START_TIMEOUT)

    def resources(self, server: str) -> list[McpResource]:
        connection = self._connection(server)
        return self._wait(self._list_resources(connection), START_TIMEOUT)

    def read_resource(self, server: str, uri: str) -> str:
        connection = self._connection(server)
        return self._wait(self._read_resource(connection, uri), START_TIMEOUT)

    def stop(self, server: str) -> None:
        with self._lock:
            connection = self._connections.pop(server, None)
        if connection is not None:
            self._stop(connection)

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            self._stop(connection)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT)

    # ------------------------------------------------------------------------------------------------- plumbing

    def _connection(self, server: str) -> _Connection:
        """The running connection to `server`, started now if it is not (or no longer) running."""
        if server not in self.entries:
            raise McpError(f"no MCP server named {server!r} is configured", hint="see `localllm mcp list`")
        with self._lock:
            connection = self._connections.get(server)
            if connection is not None and connection.alive:
                return connection
            connection = self._wait(self._start(self.entries[server]), START_TIMEOUT)
            self._connections[server] = connection
            return connection

    def _wait(
        self, coroutine: Coroutine[Any, Any, T], timeout: float, cancelled: Callable[[], bool] = lambda: False
    ) -> T:
        """Run `coroutine` on the manager's loop and wait for it; Ctrl-C here, or `cancelled()`, cancels it there."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    return future.result(min(CANCEL_POLL, max(deadline - time.monotonic(), 0)))
                except FutureTimeout:
                    if cancelled():
                        raise KeyboardInterrupt from None
                    if time.monotonic() >= deadline:
                        raise
        except FutureTimeout:
            future.cancel()
            raise McpTimeout(f"the MCP server did not answer within {timeout:g} s") from None
        except BaseException:
            future.cancel()
            raise

    def _stop(self, connection: _Connection) -> None:
        async def stop() -> None:
            connection.stop.set()
            if connection.task is not None:
                await asyncio.wait([connection.task], timeout=STOP_TIMEOUT)

        try:
            self._wait(stop(), STOP_TIMEOUT + 1)
        except McpError:
            pass  # a server that will not stop is killed by the SDK's own shutdown; nothing else to do

    def _forget_if_dead(self, connection: _Connection) -> None:
        if not connection.alive:
            with self._lock:
                if self._connections.get(connection.entry.name) is connection:
                    del self._connections[connection.entry.name]

    # ------------------------------------------------------------------------------------------------- on the loop

    async def _start(self, entry: ServerEntry) -> _Connection:
        connection = _Connection(entry, asyncio.Event())
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        connection.task = asyncio.create_task(self._serve(connection, ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT)
        except asyncio.TimeoutError:
            connection.stop.set()
            raise McpError(
                f"MCP server {entry.name!r} did not start within {START_TIMEOUT:g} s", hint=self._log_hint(entry)
            ) from None
        except (asyncio.CancelledError, McpError):
            connection.stop.set()
            raise
        return connection

    async def _serve(self, connection: _Connection, ready: asyncio.Future[None]) -> None:
        """Open the server's transport and session, list its tools, then hold them open until told to stop."""
        entry = connection.entry
        try:
            from mcp import ClientSession
        except ImportError:
            ready.set_exception(
                McpError("MCP tools need the mcp package", hint="install the mcp extra: bash scripts/setup.sh mcp")
            )
            return
        try:
            async with AsyncExitStack() as stack:
                errlog = stack.enter_context(self._errlog(entry))
                read, write = await stack.enter_async_context(_transport(entry, errlog))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                connection.session = session
                connection.tools = await _list_tools(entry.name, session)
                connection.alive = True
                ready.set_result(None)
                await connection.stop.wait()
        except Exception as exc:  # the SDK's errors, OSError for a command that is not there, ExceptionGroups
            if not ready.done():
                ready.set_exception(
                    McpError(f"MCP server {entry.name!r} could not start: {_reason(exc)}", hint=self._log_hint(entry))
                )
        finally:
            connection.alive = False
            if not ready.done():
                ready.cancel()

    async def _call(self, connection: _Connection, tool: str, arguments: dict[str, Any], timeout: float) -> ToolResult:
        name = connection.entry.name
        try:
            result = await asyncio.wait_for(connection.session.call_tool(tool, arguments), timeout)
        except asyncio.TimeoutError:
            raise McpTimeout(f"{name}/{tool} ran past its time limit of {timeout:g} s and was cancelled") from None
        except Exception as exc:
            if _connection_closed(exc):  # the server died: the next use starts it again
                connection.alive = False
                connection.stop.set()
                raise McpError(
                    f"{name}/{tool} failed: the server stopped", hint=self._log_hint(connection.entry)
                ) from None
            raise McpError(f"{name}/{tool} failed: {_reason(exc)}") from None
        return ToolResult(result_text(result), bool(result.is_error))

    async def _list_prompts(self, connection: _Connection) -> list[McpPrompt]:
        session = connection.session
        if session.server_capabilities is None or session.server_capabilities.prompts is None:
            return []
        listed = await session.list_prompts()
        prompts = []
        for prompt in listed.prompts:
            arguments = prompt.arguments or []
            required = tuple(a.name for a in arguments if a.required)
            names = required + tuple(a.name for a in arguments if not a.required)
            prompts.append(McpPrompt(connection.entry.name, prompt.name, prompt.description or "", names, required))
        return prompts

    async def _get_prompt(self, connection: _Connection, name: str, arguments: dict[str, str]) -> list[tuple[str, str]]:
        result = await connection.session.get_prompt(name, arguments)
        return [(message.role, content_text(message.content)) for message in result.messages]

    async def _list_resources(self, connection: _Connection) -> list[McpResource]:
        session = connection.session
        if session.server_capabilities is None or session.server_capabilities.resources is None:
            return []
        listed = await session.list_resources()
        return [McpResource(connection.entry.name, str(r.uri), r.name, r.description or "") for r in listed.resources]

    async def _read_resource(self, connection: _Connection, uri: str) -> str:
        result = await connection.session.read_resource(uri)
        return "\n".join(resource_text(part) for part in result.contents)

    def _errlog(self, entry: ServerEntry) -> TextIO:
        path = self._log_path(entry)
        if path is None:
            return open("/dev/null" if Path("/dev/null").exists() else "nul", "w")  # noqa: SIM115
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a", encoding="utf-8")

    def _log_path(self, entry: ServerEntry) -> Path | None:
        return self._log_dir / f"mcp-{entry.name}.log" if self._log_dir is not None else None

    def _log_hint(self, entry: ServerEntry) -> str:
        path = self._log_path(entry)
        if entry.url is not None:
            where = "check its url and headers"
        else:
            where = f"its stderr is in {path}" if path is not None else "check its command"
        return f"{where}; try `localllm mcp test {entry.name}`"


def _transport(entry: ServerEntry, errlog: TextIO):
    """The SDK transport for an entry: a stdio process (arguments as a list, no shell) or streamable HTTP."""
    if entry.command is not None:
        from mcp.client.stdio import StdioServerParameters, stdio_client

        parameters = StdioServerParameters(
            command=entry.command, args=list(entry.args), env=dict(entry.env) or None, cwd=entry.cwd
        )
        return stdio_client(parameters, errlog=errlog)
    return _http_transport(entry)


def _http_transport(entry: ServerEntry):
    from contextlib import asynccontextmanager

    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    @asynccontextmanager
    async def transport():
        async with create_mcp_http_client(headers=dict(entry.headers)) as http:
            async with streamable_http_client(str(entry.url), http_client=http) as streams:
                yield streams[0], streams[1]

    return transport()


async def _list_tools(server: str, session: Any) -> list[McpTool]:
    tools: list[McpTool] = []
    cursor = None
    while True:
        from mcp.types import PaginatedRequestParams

        listed = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += [McpTool(server, t.name, t.description or "", dict(t.input_schema or {})) for t in listed.tools]
        cursor = listed.next_cursor
        if not cursor:
            return tools


def result_text(result: Any) -> str:
    """A tool's answer as the text a model reads: its text parts, placeholders for the rest, or its structured
    content as JSON when it has no parts."""
    parts = [content_text(part) for part in result.content or []]
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


def content_text(part: Any) -> str:
    from mcp import types

    if isinstance(part, types.TextContent):
        return part.text
    if isinstance(part, types.EmbeddedResource):
        return resource_text(part.resource)
    if isinstance(part, types.ResourceLink):
        return f"[resource {part.uri}]"
    if isinstance(part, types.ImageContent | types.AudioContent):
        return f"[{part.type} content, {part.mime_type}]"
    return f"[{type(part).__name__}]"


def resource_text(contents: Any) -> str:
    from mcp import types

    if isinstance(contents, types.TextResourceContents):
        return contents.text
    return f"[binary content of {contents.uri}]"


def _connection_closed(exc: Exception) -> bool:
    from mcp.shared.exceptions import MCPError
    from mcp.types import CONNECTION_CLOSED

    return isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED


def _reason(exc: BaseException) -> str:
    """The innermost message of an error the SDK raised, often wrapped in ExceptionGroups by its task groups."""
    exc = _innermost(exc)
    text = str(exc).strip()
    return text or type(exc).__name__


if sys.version_info >= (3, 11):

    def _innermost(exc: BaseException) -> BaseException:
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # noqa: F821  (built in from 3.11)
            exc = exc.exceptions[0]
        return exc

else:

    def _innermost(exc: BaseException) -> BaseException:
        return exc
