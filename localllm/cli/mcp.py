"""`localllm mcp list|add|remove|test`: see and change the MCP servers of mcp.json (LOCALLLM_HOME's, or another by
--config or LOCALLLM_MCP_CONFIG), and check that one starts and lists its tools. Env and header values are never
printed: they often hold keys."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .. import config
from ..errors import InvalidInput
from ..mcp.config import DEFAULT_TIMEOUT, ServerEntry, config_path, load_config, parse_entry
from .app import app, console

mcp_app = typer.Typer(help="Configure the MCP servers whose tools the chats may use.", no_args_is_help=True)
app.add_typer(mcp_app, name="mcp")

CONFIG_HELP = "the mcp.json to use (default: LOCALLLM_MCP_CONFIG, else LOCALLLM_HOME/mcp.json)"


@mcp_app.command("list")
def list_servers(
    config_file: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the servers as JSON (env and header names only)"),
) -> None:
    """List the configured MCP servers."""
    servers = load_config(config_file).servers
    if as_json:
        typer.echo(json.dumps([_summary(entry) for entry in servers.values()], indent=2))
        return
    if not servers:
        console.print(f"no MCP servers in {config_path(config_file)}; add one with `localllm mcp add`", highlight=False)
        return
    for entry in servers.values():
        flags = [word for word, on in (("trusted", entry.trust), ("disabled", entry.disabled)) if on]
        secrets = [f"env: {', '.join(entry.env)}"] if entry.env else []
        secrets += [f"headers: {', '.join(entry.headers)}"] if entry.headers else []
        extra = "; ".join(flags + secrets)
        console.print(
            f"{entry.name:<16} {entry.transport:<6} {entry.describe()}{f'  ({extra})' if extra else ''}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


@mcp_app.command("add")
def add_server(
    name: str = typer.Argument(..., help="the server's name, e.g. time"),
    command: list[str] | None = typer.Argument(
        None, help="the command that starts a stdio server and its arguments (put -- before them)"
    ),
    url: str | None = typer.Option(None, "--url", help="a remote server's streamable HTTP address, instead"),
    env: list[str] = typer.Option([], "--env", "-e", help="NAME=VALUE for a stdio server's environment (repeat)"),
    header: list[str] = typer.Option([], "--header", "-H", help="NAME=VALUE header for a remote server (repeat)"),
    trust: bool = typer.Option(False, "--trust", help="run this server's tools without asking"),
    timeout: float = typer.Option(DEFAULT_TIMEOUT, "--timeout", help="seconds a tool call may run"),
    replace: bool = typer.Option(False, "--replace", help="replace a server of the same name"),
    config_file: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Add a server: `localllm mcp add time -- mcp-server-time`, or `localllm mcp add docs --url https://...`."""
    if url and command:
        raise InvalidInput("give a command or --url, not both")
    if not command and not url:
        raise InvalidInput("a server needs a command or --url", hint="localllm mcp add time -- mcp-server-time")
    loaded = load_config(config_file)
    body: dict = {"command": command[0], "args": command[1:]} if command else {"url": url}
    body |= {"env": _pairs(env, "--env"), "headers": _pairs(header, "--header"), "trust": trust, "timeout": timeout}
    entry: ServerEntry = parse_entry(name, body, loaded.path)
    loaded.add(entry, replace=replace)
    loaded.save()
    console.print(f"added MCP server '{name}' to {loaded.path}", highlight=False, markup=False)


@mcp_app.command("remove")
def remove_server(
    name: str = typer.Argument(..., help="the server's name"),
    config_file: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Remove a server from mcp.json."""
    loaded = load_config(config_file)
    loaded.remove(name)
    loaded.save()
    console.print(f"removed MCP server '{name}' from {loaded.path}", highlight=False, markup=False)


@mcp_app.command("test")
def test_server(
    name: str = typer.Argument(..., help="the server's name"),
    config_file: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the tools as JSON"),
) -> None:
    """Start the server, list its tools, and stop it."""
    from ..mcp.sessions import McpSessions

    entry = load_config(config_file).server(name)
    sessions = McpSessions([entry], log_dir=config.HOME.get() / "logs")
    try:
        tools = sessions.tools(name)
    finally:
        sessions.close()
    if as_json:
        rows = [{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in tools]
        typer.echo(json.dumps(rows, indent=2))
        return
    console.print(f"MCP server '{name}' started and lists {len(tools)} tool(s):", highlight=False, markup=False)
    for tool in tools:
        summary = tool.description.strip().splitlines()[0] if tool.description.strip() else ""
        console.print(f"  {tool.name:<28} {summary[:90]}", highlight=False, markup=False, soft_wrap=True)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            # The value may be a key: the error does not repeat it.
            raise InvalidInput(f"{flag} takes NAME=VALUE (an argument without '=' was given)")
        pairs[key] = value
    return pairs


def _summary(entry: ServerEntry) -> dict:
    return {
        "name": entry.name,
        "transport": entry.transport,
        "command": entry.command,
        "args": list(entry.args),
        "url": entry.url,
        "env": sorted(entry.env),
        "headers": sorted(entry.headers),
        "trust": entry.trust,
        "timeout": entry.timeout,
        "disabled": entry.disabled,
    }
