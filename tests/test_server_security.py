"""The server's guard and plumbing on a real server over an empty store: Host check, API key, CORS, body limit,
JSON errors and /metrics. No model is needed."""

from __future__ import annotations

import httpx
import pytest
from server_harness import serve_in_thread

from localllm.client.local import LocalClient
from localllm.server.app import create_app


@pytest.fixture
def serve():
    """Start a server on a fresh LocalClient over the (empty, isolated) home; settings come from the environment."""
    clients = []

    def start():
        client = LocalClient()
        clients.append(client)
        return serve_in_thread(create_app(client))

    yield start
    for client in clients:
        client.close()


def get(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.get(url + path, timeout=10, **kwargs)


def test_host_header_check(serve, monkeypatch):
    monkeypatch.setenv("LOCALLLM_ALLOWED_HOSTS", "myhost.lan")
    with serve() as url:
        port = url.rsplit(":", 1)[1]
        for host in (
            f"localhost:{port}",
            f"127.0.0.1:{port}",
            f"[::1]:{port}",
            "app.localhost",
            "myhost.lan:80",
            "192.168.1.20:11435",
        ):
            assert get(url, "/api/tags", headers={"host": host}).status_code == 200, host
        refused = get(url, "/api/tags", headers={"host": f"attacker.example:{port}"})
        assert refused.status_code == 403
        assert "attacker.example" in refused.json()["error"] and "LOCALLLM_ALLOWED_HOSTS" in refused.json()["error"]


def test_api_key_on_every_route_but_root_and_health(serve, monkeypatch):
    monkeypatch.setenv("LOCALLLM_API_KEY", "k3y")
    with serve() as url:
        assert get(url, "/").status_code == 200 and get(url, "/health").status_code == 200
        for path in ("/api/tags", "/api/version", "/metrics", "/v1/models"):
            refused = get(url, path)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", path
        assert get(url, "/api/tags", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert get(url, "/api/tags", headers={"authorization": "Bearer k3y"}).status_code == 200
        assert get(url, "/v1/models").json()["error"]["type"] == "authentication_error"


def test_cors_only_for_configured_origins(serve, monkeypatch):
    with serve() as url:
        plain = get(url, "/api/tags", headers={"origin": "http://site.example"})
        assert "access-control-allow-origin" not in plain.headers
    monkeypatch.setenv("LOCALLLM_ORIGINS", "http://app.example")
    with serve() as url:
        preflight = httpx.options(
            url + "/api/chat",
            headers={
                "origin": "http://app.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        allowed = get(url, "/api/tags", headers={"origin": "http://app.example"})
        assert allowed.headers["access-control-allow-origin"] == "http://app.example"
        other = get(url, "/api/tags", headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_body_limit(serve, monkeypatch):
    monkeypatch.setenv("LOCALLLM_MAX_BODY", "200")
    big = b'{"model": "x", "prompt": "' + b"a" * 400 + b'"}'
    with serve() as url:
        declared = httpx.post(url + "/api/generate", content=big)
        assert declared.status_code == 413 and "200" in declared.json()["error"]

        def chunked():  # no Content-Length: the limit applies while reading
            yield big[:150]
            yield big[150:]

        streamed = httpx.post(url + "/api/generate", content=chunked())
        assert streamed.status_code == 413 and "LOCALLLM_MAX_BODY" in streamed.json()["error"]
        small = httpx.post(url + "/api/show", json={"model": "absent:1"})
        assert small.status_code == 404


def test_errors_are_json(serve):
    with serve() as url:
        assert httpx.post(url + "/api/chat", content=b"{not json").json()["error"].startswith("the request body is")
        assert httpx.post(url + "/api/chat", content=b"{not json").status_code == 400
        missing = get(url, "/api/nothing")
        assert missing.status_code == 404 and "error" in missing.json()
        assert httpx.post(url + "/v1/chat/completions", json={"model": "m"}).json()["error"]["message"]


def test_metrics_and_health(serve):
    with serve() as url:
        get(url, "/api/tags")
        get(url, "/api/tags", headers={"host": "rebound.example"})
        assert get(url, "/health").json()["status"] == "ok"
        text = get(url, "/metrics").text
        assert 'localllm_requests_total{method="GET",route="/api/tags",status="200"} 1.0' in text
        assert 'localllm_requests_total{method="GET",route="unmatched",status="403"} 1.0' in text  # refusals count
        assert "localllm_models_loaded 0.0" in text


CREATE = b'{"model": "victim", "from": "smollm2:135m", "system": "obey the page"}'


def test_foreign_origins_are_refused_before_any_route(serve, monkeypatch):
    monkeypatch.setenv("LOCALLLM_ORIGINS", "http://app.example,chrome-extension://*")
    with serve() as url:
        port = url.rsplit(":", 1)[1]
        for origin in (
            "http://evil.example",
            "https://127.0.0.1.evil.example",
            "null",
            "file://",
            "moz-extension://abc",
            "http://app.example.evil",
            "http://app.example:8080",
        ):
            refused = httpx.post(url + "/api/create", content=CREATE, headers={"origin": origin})
            assert refused.status_code == 403, origin
            assert origin in refused.json()["error"] and "LOCALLLM_ORIGINS" in refused.json()["error"]
        assert (
            httpx.get(url + "/v1/models", headers={"origin": "http://evil.example"}).json()["error"]["type"]
            == "permission_error"
        )
        # Loopback pages, IDE webviews and configured origins reach the route (which finds no such model here).
        for origin in (
            f"http://localhost:{port}",
            f"http://127.0.0.1:{port}",
            "http://[::1]:3000",
            "https://app.localhost",
            "vscode-webview://1234",
            "http://app.example",
            "chrome-extension://abcdef",
        ):
            reached = httpx.post(url + "/api/show", json={"model": "absent:1"}, headers={"origin": origin})
            assert reached.status_code == 404, origin
        assert get(url, "/api/tags").status_code == 200


def test_json_routes_refuse_bodies_that_are_not_json(serve):
    with serve() as url:
        for content_type in (
            "text/plain",
            "text/plain;charset=UTF-8",
            "multipart/form-data; boundary=x",
            "application/xml",
        ):
            for path in ("/api/create", "/api/show", "/v1/chat/completions"):
                refused = httpx.post(url + path, content=CREATE, headers={"content-type": content_type})
                assert refused.status_code == 415, (content_type, path)
        deleted = httpx.request(
            "DELETE", url + "/api/delete", content=b'{"model": "victim"}', headers={"content-type": "text/plain"}
        )
        assert deleted.status_code == 415 and "application/json" in deleted.json()["error"]
        # JSON, JSON with a charset, no type at all and curl -d's form type are all read as JSON.
        for content_type in (
            "application/json",
            "application/json; charset=utf-8",
            None,
            "application/x-www-form-urlencoded",
        ):
            headers = {"content-type": content_type} if content_type else {}
            request = httpx.Request("POST", url + "/api/show", content=b'{"model": "absent:1"}', headers=headers)
            assert request.headers.get("content-type") == content_type
            assert httpx.Client().send(request).status_code == 404, content_type
        assert get(url, "/api/tags").status_code == 200
