"""A small stdio MCP server for the edge cases the real servers do not show: a tool that fails, one that hangs, one
that kills its own server, one that answers 10 MB; plus an echo tool, a clock that always says 09:41 (so a chat's
answer can be checked), a prompt and a resource.

Run as `python tests/mcp_edge_server.py [TOOL ...]`: with tool names, only those are offered (a small model chooses
better among few). `EDGE_MARKER`, when set, is a file the server touches as it starts (a test counts starts);
`EDGE_CANCELLED`, when set, a file `hang` writes to when its call is cancelled (a test sees a Stop reach it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("edge")

BIG_BYTES = 10 * 2**20


def echo(text: str) -> str:
    """Return the text it is given."""
    return text


def city_time(city: str) -> str:
    """Get the current local time in a city."""
    return f"The local time in {city} is 09:41."


def fail(reason: str = "it always fails") -> str:
    """A tool that raises an error."""
    raise RuntimeError(reason)


async def hang(city: str = "") -> str:
    """A tool that never answers (the time in a city, too slowly)."""
    try:
        await anyio.sleep_forever()
    finally:  # cancelled by the client (or the server stops)
        cancelled = os.environ.get("EDGE_CANCELLED")
        if cancelled:
            with Path(cancelled).open("a") as file:
                file.write("cancelled\n")
    return ""


def crash() -> str:
    """A tool that kills its own server mid-call."""
    os._exit(3)


def big() -> str:
    """A tool that returns 10 MB of text."""
    return "x" * BIG_BYTES


@server.prompt()
def haiku(topic: str) -> str:
    """Ask for a haiku about a topic."""
    return f"Write a haiku about {topic}."


@server.resource("note://greeting", mime_type="text/plain")
def greeting() -> str:
    """A short note."""
    return "The password of the day is swordfish."


if __name__ == "__main__":
    offered = set(sys.argv[1:])
    for tool in (echo, city_time, fail, hang, crash, big):
        if not offered or tool.__name__ in offered:
            server.add_tool(tool)
    marker = os.environ.get("EDGE_MARKER")
    if marker:
        with Path(marker).open("a") as file:
            file.write("started\n")
    server.run()
