"""The real MCP servers the MCP tests use, as mcp.json entries: `mcp-server-time` and `mcp-server-git` (PyPI, in the
venv through the dev extra), `@modelcontextprotocol/server-filesystem` and `server-everything` (npm, installed once
per machine into a cache outside the tree and run with node), and tests/mcp_edge_server.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NPM_PACKAGES = ("@modelcontextprotocol/server-filesystem", "@modelcontextprotocol/server-everything")
EDGE_SERVER = Path(__file__).with_name("mcp_edge_server.py")


def npm_cache() -> Path:
    """Where the npm servers live (scripts/test.sh installs them there too)."""
    default = Path.home() / ".cache" / "localllm-tests" / "mcp-npm"
    return Path(os.environ.get("LOCALLLM_TEST_MCP_NPM", default)).expanduser()


def npm_server(package: str) -> Path:
    """The entry script of an npm MCP server, installed into the cache on first use; skips without npm or node."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the npm MCP servers cannot run (apt-get install nodejs npm)")
    cache = npm_cache()
    script = cache / "node_modules" / package / "dist" / "index.js"
    if not script.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(cache), *NPM_PACKAGES],
            check=True,
            capture_output=True,
            timeout=600,
        )
    return script


def venv_script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def time_entry() -> dict:
    return {"command": venv_script("mcp-server-time"), "args": ["--local-timezone", "UTC"]}


def edge_entry(**extra) -> dict:
    return {"command": sys.executable, "args": [str(EDGE_SERVER)], **extra}
