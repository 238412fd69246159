"""The web page's MCP routes on a real server over an empty store (no model): off unless MCP is on, the page's own
origin only, the API key as on every route, only the tools mcp.json names, and a tool's failure as an error result;
the servers' prompts and resources; a call cancelled on the MCP server when its page goes away."""

from __future__ import annotations

import json
import time

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


def test_the_page_lists_and_gets_prompts_and_resources(serve):
    with serve(mcp=True) as url:
        own = {"Origin": url}
        prompts = httpx.get(f"{url}/api/mcp/prompts", headers=own, timeout=60).json()["prompts"]
        assert prompts == [
            {
                "name": "haiku",
                "server": "edge",
                "description": "Ask for a haiku about a topic.",
                "arguments": ["topic"],
                "required": ["topic"],
            }
        ]
        got = httpx.post(f"{url}/api/mcp/prompt", json={"name": "haiku", "line": "'the sea'"}, headers=own, timeout=60)
        assert got.json() == {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]}
        missing = httpx.post(f"{url}/api/mcp/prompt", json={"name": "haiku"}, headers=own, timeout=60)
        assert missing.status_code == 400 and "needs topic" in missing.json()["error"]

        [resource] = httpx.get(f"{url}/api/mcp/resources", headers=own, timeout=60).json()["resources"]
        assert resource["uri"] == "note://greeting" and resource["server"] == "edge"
        read = httpx.post(f"{url}/api/mcp/resource", json={"uri": "note://greeting"}, headers=own, timeout=60)
        assert read.json() == {"uri": "note://greeting", "text": "The password of the day is swordfish."}
        unknown = httpx.post(f"{url}/api/mcp/resource", json={"uri": "file:///etc/passwd"}, headers=own, timeout=60)
        assert unknown.status_code == 404

        foreign = {"Origin": "https://evil.example"}
        assert httpx.get(f"{url}/api/mcp/prompts", headers=foreign, timeout=30).status_code == 403
        body = {"uri": "note://greeting"}
        assert httpx.post(f"{url}/api/mcp/resource", json=body, headers=foreign, timeout=30).status_code == 403
        assert httpx.post(f"{url}/api/mcp/resource", json=body, timeout=30).status_code == 403  # no Origin


def test_a_page_that_goes_away_cancels_its_call_on_the_mcp_server(isolated_home, monkeypatch, tmp_path):
    """The page's Stop aborts its request; the server sees the page leave and cancels the MCP call, which the edge
    server's hang tool writes down."""
    cancelled = tmp_path / "cancelled"
    isolated_home.mkdir(parents=True, exist_ok=True)
    servers = {"edge": edge_entry(args=[str(EDGE_SERVER), "hang"], timeout=600, env={"EDGE_CANCELLED": str(cancelled)})}
    (isolated_home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    client = LocalClient()
    try:
        with serve_in_thread(create_app(client, mcp=True)) as url:
            own = {"Origin": url}
            assert httpx.get(f"{url}/api/mcp/tools", headers=own, timeout=60).status_code == 200  # started
            with pytest.raises(httpx.ReadTimeout):  # the request is given up, as the page's Stop aborts it
                httpx.post(f"{url}/api/mcp/call", json={"name": "hang"}, headers=own, timeout=2)
            for _ in range(300):
                if cancelled.exists():
                    break
                time.sleep(0.1)
            assert cancelled.read_text() == "cancelled\n"  # while the server still runs: the call was cancelled
    finally:
        client.close()
