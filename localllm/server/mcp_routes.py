"""The routes the web page's MCP tools need (a localllm extension): the tools of mcp.json's servers, and one call of
one tool. A browser cannot start processes, so the tools run where the server runs; the page runs the tool loop
itself (web/tools.js) through /api/chat and these routes, with the same confirmation as the other chats.

Off unless the server was started with MCP on (`serve --mcp` or LOCALLLM_MCP): then 404 says how. Only the page's
own origin may call them (the guard's loopback and LOCALLLM_ORIGINS pages may not), a call needs a browser's
Origin, and the API key rules of every other route apply (security.py). Only tools of the servers mcp.json names
run, with their arguments as the protocol's JSON."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..errors import Forbidden, ModelNotFound
from ..mcp.tool_loop import PendingCall, Toolbox, run_call

router = APIRouter()


class ToolCallBody(BaseModel):
    name: str = Field(description="the tool's name as GET /api/mcp/tools lists it")
    arguments: dict[str, Any] = Field(default_factory=dict)


def _toolbox(request: Request) -> Toolbox:
    toolbox = request.app.state.mcp
    if toolbox is None:
        raise ModelNotFound(
            "MCP tools are off on this server",
            hint="start it with `localllm serve --mcp` (or LOCALLLM_MCP=1), with servers in mcp.json",
        )
    return toolbox


def _same_origin(request: Request, *, required: bool) -> None:
    """The page's own origin only: the Origin a browser sends must name this server as the page reached it."""
    origin = request.headers.get("origin")
    if origin is None and not required:
        return
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is None or origin.lower() != own.lower():
        raise Forbidden(
            f"the MCP routes answer only this server's own web page, not {origin!r}",
            hint="use the page this server serves at /",
        )


def _offered(toolbox: Toolbox) -> dict:
    notes: list[str] = []
    return {"tools": toolbox.offered(notes.append), "notes": notes}


@router.get("/api/mcp/tools")
async def list_tools(request: Request) -> JSONResponse:
    """The enabled servers' tools by the name a model sees, with whether they run without asking."""
    _same_origin(request, required=False)
    toolbox = _toolbox(request)
    offered = await run_in_threadpool(_offered, toolbox)  # may start the servers
    rows = [
        {
            "name": name,
            "server": tool.server,
            "tool": tool.name,
            "description": tool.description,
            "parameters": tool.input_schema or {"type": "object", "properties": {}},
            "trusted": toolbox.trust_all or toolbox.sessions.entries[tool.server].trust,
        }
        for name, tool in offered["tools"].items()
    ]
    return JSONResponse({"tools": rows, "notes": offered["notes"]})


@router.post("/api/mcp/call")
async def call_tool(body: ToolCallBody, request: Request) -> JSONResponse:
    """Run one tool the page confirmed: its result bounded in size, or its failure as an error text for the model."""
    _same_origin(request, required=True)
    toolbox = _toolbox(request)
    tools = await run_in_threadpool(toolbox.offered, lambda note: None)
    tool = tools.get(body.name)
    if tool is None:
        raise ModelNotFound(f"no MCP tool named {body.name!r}", hint="see GET /api/mcp/tools")
    call = PendingCall(tool.server, tool.name, body.arguments, body.name)
    outcome = await run_in_threadpool(run_call, toolbox, call)
    return JSONResponse(
        {
            "server": tool.server,
            "tool": tool.name,
            "status": outcome.status,
            "text": outcome.text,
            "truncated": outcome.truncated,
        }
    )


def open_server_toolbox(enabled: bool) -> Toolbox | None:
    """The server's toolbox when MCP is on: mcp.json's enabled servers (started on first use), else None."""
    if not enabled:
        return None
    from .. import config
    from ..mcp.config import load_config
    from ..mcp.sessions import McpSessions

    entries = load_config().enabled()
    return Toolbox(McpSessions(entries, log_dir=config.HOME.get() / "logs"))
