"""Test helpers for Ollama's model formats: a loopback registry that speaks the protocol `ollama pull` uses, and
Ollama's on-disk store written as Ollama writes it.

    GET /v2/<namespace>/<name>/manifests/<tag>   the manifest (404 with MANIFEST_UNKNOWN for an unknown one)
    GET /v2/<namespace>/<name>/blobs/<digest>    307 to the "CDN": a second loopback server (hfserver's Hub) that
                                                 serves /files/<hex>, with Range, ETag and dropped connections

A manifest can be dripped one byte every `drip` seconds (until `stop_drip` is set), as a stalled server would.
`publish` puts a model in both; `write_ollama_store` lays out `manifests/<host>/<ns>/<name>/<tag>` and
`blobs/sha256-<hex>` under a folder, as OLLAMA_MODELS holds them."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hfserver import Hub

MANIFEST_MEDIA = "application/vnd.docker.distribution.manifest.v2+json"
CHATML_GO = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"

Layers = list[tuple[str, bytes]]  # (kind: model, template, system, params, ..., the layer's bytes)


def manifest_bytes(layers: Layers, *, sizes: dict[str, int] | None = None) -> bytes:
    """An Ollama manifest naming each layer by sha256 (`sizes` overrides a kind's announced size)."""
    config = b'{"model_format":"gguf","model_family":"llama"}'
    body = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA,
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
            "size": len(config),
        },
        "layers": [
            {
                "mediaType": kind if "/" in kind else f"application/vnd.ollama.image.{kind}",
                "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                "size": (sizes or {}).get(kind, len(data)),
            }
            for kind, data in layers
        ],
    }
    return json.dumps(body).encode()


@dataclass
class Registry:
    """What the registry serves; `requests` logs (path, Accept header)."""

    cdn: Hub
    cdn_url: str = ""
    manifests: dict[tuple[str, str], bytes] = field(default_factory=dict)
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    drip: float = 0.0
    stop_drip: threading.Event = field(default_factory=threading.Event)

    def publish(self, repo: str, tag: str, layers: Layers, *, served: dict[str, bytes] | None = None) -> None:
        """Serve a model: its manifest here, its layers on the CDN (`served` replaces a kind's bytes there)."""
        self.manifests[(repo, tag)] = manifest_bytes(layers)
        for kind, data in layers:
            self.cdn.files[hashlib.sha256(data).hexdigest()] = (served or {}).get(kind, data)

    def blob_requests(self) -> list[str]:
        return [path for path, _ in self.requests if "/blobs/" in path]


class _Handler(BaseHTTPRequestHandler):
    registry: Registry
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.registry.requests.append((self.path, self.headers.get("Accept")))
        manifest = re.match(r"^/v2/([^/]+/[^/]+)/manifests/([^/]+)$", self.path)
        blob = re.match(r"^/v2/([^/]+/[^/]+)/blobs/sha256:([0-9a-f]{64})$", self.path)
        if manifest and (manifest.group(1), manifest.group(2)) in self.registry.manifests:
            body = self.registry.manifests[(manifest.group(1), manifest.group(2))]
            if self.registry.drip:
                self._drip(body)
                return
            self._send(200, body, {"Content-Type": MANIFEST_MEDIA})
        elif blob and blob.group(2) in self.registry.cdn.files:
            self._send(307, b"", {"Location": f"{self.registry.cdn_url}/files/{blob.group(2)}"})
        else:
            code = "MANIFEST_UNKNOWN" if manifest else "BLOB_UNKNOWN"
            self._send(404, json.dumps({"errors": [{"code": code, "message": "not found"}]}).encode(), {})

    def _drip(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", MANIFEST_MEDIA)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for index in range(len(body)):
            if self.registry.stop_drip.wait(self.registry.drip):
                break
            try:
                self.wfile.write(body[index : index + 1])
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client gave up
                break
        self.close_connection = True

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class RegistryServer:
    """`with RegistryServer(registry) as url:` serves it on 127.0.0.1 at a free port until the block ends."""

    def __init__(self, registry: Registry):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"registry": registry}))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def write_ollama_store(root: Path, models: dict[str, Layers], *, host: str = "registry.ollama.ai") -> Path:
    """Ollama's store under `root`: for each `namespace/name:tag`, a manifest and its blobs (written once)."""
    for name, layers in models.items():
        repo, tag = name.rsplit(":", 1)
        path = root / "manifests" / host / repo / tag
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(manifest_bytes(layers))
        for _, data in layers:
            blob = root / "blobs" / f"sha256-{hashlib.sha256(data).hexdigest()}"
            if not blob.exists():
                blob.parent.mkdir(parents=True, exist_ok=True)
                blob.write_bytes(data)
    return root
