"""The routes the web page's MCP tools need (a localllm extension): the tools of mcp.json's servers, and one call of
one tool; the servers' prompts and resources (mcp/prompts.py, as the chats' /prompt and /resource). A browser
cannot start processes, so the tools run where the server runs; the page runs the tool loop itself (web/tools.js)
through /api/chat and these routes, with the same confirmation as the other chats.

Off unless the server was started with MCP on (`serve --mcp` or LOCALLLM_MCP): then 404 says how. Only the page's
own origin may call them (the guard's loopback and LOCALLLM_ORIGINS pages may not), a call needs a browser's
Origin, and the API key rules of every other route apply (security.py). Only tools of the servers mcp.json names
run, with their arguments as the protocol's JSON. A call whose page goes away (its Stop) is cancelled on the MCP
server, not only in the browser."""

from __future__ import annotations

import asyncio
import shlex
import threading
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..errors import Forbidden, InvalidInput, ModelNotFound
from ..mcp.prompts import listed_prompts, listed_resources, prompt_arguments, resource_text
from ..mcp.tool_loop import CallOutcome, PendingCall, Toolbox, run_call

router = APIRouter()

DISCONNECT_POLL = 0.2  # seconds between looks at whether the page that asked for a call is still there


class PromptBody(BaseModel):
    name: str = Field(description="the prompt's name as GET /api/mcp/prompts lists it")
    line: str = Field("", description="its arguments as typed after /prompt NAME: values in order, or NAME=VALUE")


class ResourceBody(BaseModel):
    uri: str = Field(description="the resource's URI as GET /api/mcp/resources lists it")


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
    outcome = await _run_while_connected(request, toolbox, call)
    if outcome is None:  # the page went away (its Stop): nobody reads this
        return JSONResponse({"server": tool.server, "tool": tool.name, "status": "stopped"}, status_code=499)
    return JSONResponse(
        {
            "server": tool.server,
            "tool": tool.name,
            "status": outcome.status,
            "text": outcome.text,
            "truncated": outcome.truncated,
        }
    )


async def _run_while_connected(request: Request, toolbox: Toolbox, call: PendingCall) -> CallOutcome | None:
    """Run the call in a thread; if the page disconnects first (its Stop aborts the request), the call is cancelled
    on the MCP server, as Ctrl-C cancels it in the terminal, and None comes back."""
    stopped = threading.Event()
    running = asyncio.ensure_future(run_in_threadpool(_run_stoppable, toolbox, call, stopped))
    while not running.done():
        await asyncio.wait({running}, timeout=DISCONNECT_POLL)
        if not running.done() and await request.is_disconnected():
            stopped.set()
    return running.result()


def _run_stoppable(toolbox: Toolbox, call: PendingCall, stopped: threading.Event) -> CallOutcome | None:
    try:
        return run_call(toolbox, call, cancelled=stopped.is_set)
    except KeyboardInterrupt:  # how the sessions say a call was cancelled by its caller
        return None


@router.get("/api/mcp/prompts")
async def list_prompts(request: Request) -> JSONResponse:
    """The enabled servers' prompts, with their arguments (required ones first) for `/prompt NAME ARGS`."""
    _same_origin(request, required=False)
    toolbox = _toolbox(request)
    notes: list[str] = []
    prompts = await run_in_threadpool(listed_prompts, toolbox, notes.append)
    rows = [
        {
            "name": p.name,
            "server": p.server,
            "description": p.description,
            "arguments": list(p.arguments),
            "required": list(p.required),
        }
        for p in prompts.values()
    ]
    return JSONResponse({"prompts": rows, "notes": notes})


@router.post("/api/mcp/prompt")
async def get_prompt(body: PromptBody, request: Request) -> JSONResponse:
    """A prompt's messages, as (role, content), for the page to insert into the chat."""
    _same_origin(request, required=True)
    toolbox = _toolbox(request)
    prompts = await run_in_threadpool(listed_prompts, toolbox, lambda note: None)
    prompt = prompts.get(body.name)
    if prompt is None:
        raise ModelNotFound(f"no MCP prompt named {body.name!r}", hint="see GET /api/mcp/prompts")
    try:
        words = shlex.split(body.line)
    except ValueError as exc:
        raise InvalidInput(f"/prompt {body.name}: {exc}", hint="close the quotes around a value") from None
    arguments = prompt_arguments(prompt, words)
    messages = await run_in_threadpool(toolbox.sessions.get_prompt, prompt.server, prompt.name, arguments)
    return JSONResponse({"messages": [{"role": role, "content": text} for role, text in messages]})


@router.get("/api/mcp/resources")
async def list_resources(request: Request) -> JSONResponse:
    """The enabled servers' resources, to attach to a message."""
    _same_origin(request, required=False)
    toolbox = _toolbox(request)
    notes: list[str] = []
    resources = await run_in_threadpool(listed_resources, toolbox, notes.append)
    rows = [
        {"uri": r.uri, "server": r.server, "name": r.name, "description": r.description} for r in resources.values()
    ]
    return JSONResponse({"resources": rows, "notes": notes})


@router.post("/api/mcp/resource")
async def read_resource(body: ResourceBody, request: Request) -> JSONResponse:
    """A resource's text, bounded as a tool's result is, for the page to attach as context."""
    _same_origin(request, required=True)
    toolbox = _toolbox(request)
    resources = await run_in_threadpool(listed_resources, toolbox, lambda note: None)
    resource = resources.get(body.uri)
    if resource is None:
        raise ModelNotFound(f"no MCP resource {body.uri!r}", hint="see GET /api/mcp/resources")
    text = await run_in_threadpool(resource_text, toolbox, resource)
    return JSONResponse({"uri": resource.uri, "text": text})


def open_server_toolbox(enabled: bool) -> Toolbox | None:
    """The server's toolbox when MCP is on: mcp.json's enabled servers (started on first use), else None."""
    if not enabled:
        return None
    from .. import config
    from ..mcp.config import load_config
    from ..mcp.sessions import McpSessions

    entries = load_config().enabled()
    return Toolbox(McpSessions(entries, log_dir=config.HOME.get() / "logs"))
