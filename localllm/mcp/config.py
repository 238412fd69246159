"""The MCP servers a user has named, in the `mcp.json` format Claude Desktop, Cursor and LM Studio write:

    {"mcpServers": {
        "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}},
        "docs": {"url": "https://example.org/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A stdio server has `command` (with `args`, `env`, `cwd`); a remote one has `url` (streamable HTTP) with `headers`.
localllm reads three more keys of an entry: `trust` (its tools run without asking), `timeout` (seconds a call may
take, default 60) and `disabled` (as Cline writes it). Keys it does not know are kept when the file is written
back, so an entry another client wrote survives `localllm mcp add|remove`. Env and header values are secrets:
nothing here prints or logs them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import config
from ..errors import InvalidInput

# A server's name prefixes its tools' names when two servers offer the same tool, and models' tool names are
# letters, digits, _ and -.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


DEFAULT_TIMEOUT = 60.0  # seconds a tool call may run before it is cancelled


@dataclass(frozen=True)
class ServerEntry:
    """One server of mcp.json: stdio (command) or streamable HTTP (url)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    trust: bool = False
    timeout: float = DEFAULT_TIMEOUT
    disabled: bool = False

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"

    def describe(self) -> str:
        """The command line or URL, with no env or header values (they may hold keys)."""
        if self.command is not None:
            return " ".join([self.command, *self.args])
        return str(self.url)


def config_path(path: Path | None = None) -> Path:
    """The mcp.json to use: the one given (a --config flag), else LOCALLLM_MCP_CONFIG, else LOCALLLM_HOME's."""
    return path if path is not None else config.MCP_CONFIG.get()


@dataclass
class McpConfig:
    """mcp.json as read: the servers by name, and the file's whole JSON (so unknown keys are written back)."""

    path: Path
    raw: dict[str, Any]

    @property
    def servers(self) -> dict[str, ServerEntry]:
        return {name: parse_entry(name, body, self.path) for name, body in self._table().items()}

    def enabled(self) -> list[ServerEntry]:
        return [entry for entry in self.servers.values() if not entry.disabled]

    def server(self, name: str) -> ServerEntry:
        servers = self.servers
        if name not in servers:
            known = ", ".join(sorted(servers)) or "none yet"
            raise InvalidInput(
                f"no MCP server named {name!r} in {self.path}", hint=f"configured: {known}; see `localllm mcp list`"
            )
        return servers[name]

    def add(self, entry: ServerEntry, *, replace: bool = False) -> None:
        table = self._table()
        if entry.name in table and not replace:
            raise InvalidInput(
                f"an MCP server named {entry.name!r} is already in {self.path}",
                hint="remove it first, or pass --replace",
            )
        table[entry.name] = entry_json(entry)

    def remove(self, name: str) -> None:
        self.server(name)  # the clear error for a name that is not there
        del self._table()[name]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(self.raw, indent=2) + "\n", encoding="utf-8")
        temporary.replace(self.path)

    def _table(self) -> dict[str, Any]:
        return self.raw.setdefault("mcpServers", {})


def load_config(path: Path | None = None) -> McpConfig:
    """Read mcp.json (an absent file is an empty config); a file that does not parse is an error naming it."""
    where = config_path(path)
    if not where.exists():
        return McpConfig(where, {"mcpServers": {}})
    try:
        raw = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"{where} cannot be read as JSON: {exc}", hint="fix or remove the file") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("mcpServers", {}), dict):
        raise InvalidInput(
            f"{where} is not an mcp.json", hint='it holds an object {"mcpServers": {"name": {...}, ...}}'
        )
    loaded = McpConfig(where, raw)
    _ = loaded.servers  # every entry checked now, so a bad one is reported before any server starts
    return loaded


def parse_entry(name: str, body: Any, path: Path) -> ServerEntry:
    """One `mcpServers` entry, checked: the error names the server, the key and the file."""
    where = f"MCP server {name!r} in {path}"
    if not _NAME.match(name):
        raise InvalidInput(f"{where}: the name is not usable", hint="use letters, digits, _ and - (64 at most)")
    if not isinstance(body, dict):
        raise InvalidInput(f"{where} is not an object", hint='e.g. {"command": "mcp-server-time"}')
    command, url = body.get("command"), body.get("url") or body.get("serverUrl")
    if (command is None) == (url is None):
        raise InvalidInput(f"{where} needs exactly one of command (stdio) or url (streamable HTTP)")
    if url is not None and not (isinstance(url, str) and re.match(r"^https?://", url)):
        raise InvalidInput(f"{where}: url must be an http:// or https:// address")
    return ServerEntry(
        name=name,
        command=_text(body, "command", where),
        args=tuple(_strings(body, "args", where)),
        env=_mapping(body, "env", where),
        cwd=_text(body, "cwd", where),
        url=url,
        headers=_mapping(body, "headers", where),
        trust=_flag(body, "trust", where),
        timeout=_seconds(body, "timeout", where),
        disabled=_flag(body, "disabled", where),
    )


def entry_json(entry: ServerEntry) -> dict[str, Any]:
    """An entry as mcp.json writes it (only the keys that are set)."""
    body: dict[str, Any] = {}
    if entry.command is not None:
        body["command"] = entry.command
        if entry.args:
            body["args"] = list(entry.args)
        if entry.env:
            body["env"] = dict(entry.env)
        if entry.cwd:
            body["cwd"] = entry.cwd
    else:
        body["url"] = entry.url
        if entry.headers:
            body["headers"] = dict(entry.headers)
    if entry.trust:
        body["trust"] = True
    if entry.timeout != DEFAULT_TIMEOUT:
        body["timeout"] = entry.timeout
    if entry.disabled:
        body["disabled"] = True
    return body


def _text(body: dict[str, Any], key: str, where: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidInput(f"{where}: {key} must be a non-empty string")
    return value


def _strings(body: dict[str, Any], key: str, where: str) -> list[str]:
    value = body.get(key, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidInput(f"{where}: {key} must be a list of strings")
    return value


def _mapping(body: dict[str, Any], key: str, where: str) -> dict[str, str]:
    value = body.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        # The values are secrets: the error names the key, never a value.
        raise InvalidInput(f"{where}: {key} must map names to strings")
    return dict(value)


def _seconds(body: dict[str, Any], key: str, where: str) -> float:
    value = body.get(key, DEFAULT_TIMEOUT)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86400:
        raise InvalidInput(f"{where}: {key} must be a number of seconds above 0 (a day at most)")
    return float(value)


def _flag(body: dict[str, Any], key: str, where: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"{where}: {key} must be true or false")
    return value
