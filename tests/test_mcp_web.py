"""The web page's MCP routes on a real server over an empty store (no model): off unless MCP is on, the page's own
origin only, the API key as on every route, only the tools mcp.json names, and a tool's failure as an error result."""

from __future__ import annotations

import json

import httpx
import pytest
from mcp_servers import EDGE_SERVER, edge_entry
from server_harness import serve_in_thread

from localllm.client.local import LocalClient
from localllm.server.app import create_app


@pytest.fixture
def serve(isolated_home, monkeypatch):
    """Start a server with an edge server in LOCALLLM_HOME's mcp.json; `mcp` turns the routes on."""
    isolated_home.mkdir(parents=True, exist_ok=True)
    servers = {"edge": edge_entry(args=[str(EDGE_SERVER), "echo", "fail"], timeout=10)}
    (isolated_home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    clients = []

    def start(*, mcp: bool | None = None):
        client = LocalClient()
        clients.append(client)
        return serve_in_thread(create_app(client, mcp=mcp))

    yield start
    for client in clients:
        client.close()


def test_the_routes_are_off_unless_mcp_is_on(serve):
    with serve() as url:
        response = httpx.get(f"{url}/api/mcp/tools", timeout=30)
    assert response.status_code == 404 and "serve --mcp" in response.json()["error"]


def test_the_page_lists_and_calls_the_configured_tools(serve):
    with serve(mcp=True) as url:
        own = {"Origin": url}
        listed = httpx.get(f"{url}/api/mcp/tools", headers=own, timeout=60).json()
        assert {row["name"] for row in listed["tools"]} == {"echo", "fail"}
        assert listed["tools"][0]["server"] == "edge" and listed["tools"][0]["trusted"] is False
        called = httpx.post(
            f"{url}/api/mcp/call", json={"name": "echo", "arguments": {"text": "hi"}}, headers=own, timeout=60
        )
        assert called.json() == {"server": "edge", "tool": "echo", "status": "ok", "text": "hi", "truncated": False}
        failed = httpx.post(f"{url}/api/mcp/call", json={"name": "fail"}, headers=own, timeout=60).json()
        assert failed["status"] == "error" and failed["text"].startswith("Error:")
        unknown = httpx.post(f"{url}/api/mcp/call", json={"name": "rm_rf"}, headers=own, timeout=60)
        assert unknown.status_code == 404 and "no MCP tool named 'rm_rf'" in unknown.json()["error"]


def test_only_the_pages_own_origin_may_call(serve, monkeypatch):
    monkeypatch.setenv("LOCALLLM_ORIGINS", "http://127.0.0.1:5173")  # a page the guard lets call other routes
    with serve(mcp=True) as url:
        body = {"name": "echo", "arguments": {"text": "hi"}}
        other = httpx.post(f"{url}/api/mcp/call", json=body, headers={"Origin": "http://127.0.0.1:5173"}, timeout=30)
        assert other.status_code == 403 and "only this server's own web page" in other.json()["error"]
        scripted = httpx.post(f"{url}/api/mcp/call", json=body, timeout=30)  # no Origin: not the page
        assert scripted.status_code == 403
        foreign = httpx.get(f"{url}/api/mcp/tools", headers={"Origin": "https://evil.example"}, timeout=30)
        assert foreign.status_code == 403


def test_the_api_key_is_needed_as_on_every_route(serve, monkeypatch):
    monkeypatch.setenv("LOCALLLM_API_KEY", "sekrit")
    with serve(mcp=True) as url:
        own = {"Origin": url}
        assert httpx.get(f"{url}/api/mcp/tools", headers=own, timeout=30).status_code == 401
        keyed = {**own, "Authorization": "Bearer sekrit"}
        assert httpx.get(f"{url}/api/mcp/tools", headers=keyed, timeout=60).status_code == 200
