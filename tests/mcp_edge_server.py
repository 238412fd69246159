"""A small stdio MCP server for the edge cases the real servers do not show: a tool that fails, one that hangs, one
that kills its own server, one that answers 10 MB; plus an echo tool, a prompt and a resource.

Run as `python tests/mcp_edge_server.py`. `EDGE_MARKER`, when set, is a file the server touches as it starts (a test
counts starts with it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mcp.server.mcpserver import MCPServer

server = MCPServer("edge")

BIG_BYTES = 10 * 2**20


@server.tool()
def echo(text: str) -> str:
    """Return the text it is given."""
    return text


@server.tool()
def fail(reason: str = "it always fails") -> str:
    """A tool that raises an error."""
    raise RuntimeError(reason)


@server.tool()
def hang(city: str = "") -> str:
    """A tool that never answers (the time in a city, too slowly)."""
    while True:
        time.sleep(1)


@server.tool()
def crash() -> str:
    """A tool that kills its own server mid-call."""
    os._exit(3)


@server.tool()
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
    marker = os.environ.get("EDGE_MARKER")
    if marker:
        with Path(marker).open("a") as file:
            file.write("started\n")
    server.run()
