"""Test helpers for pulls: a tiny valid GGUF written with the `gguf` package, and a loopback HTTP server that serves
a file tree the way the Hugging Face hub does for the calls huggingface_hub and our downloader make:

    GET /api/models/<org>/<repo>[/revision/<rev>]   model info; with ?blobs=true each sibling has size and lfs.sha256
    GET|HEAD /<org>/<repo>/resolve/<rev>/<file>      the bytes, honouring Range, with X-Repo-Commit and ETag
    GET /files/<file>                                a plain download (for URL pulls)

Behaviours a test can switch on: drop the connection after some bytes (`drop_after`, for the first N responses),
serve other bytes than the sha256 the model info announces (`corrupt`), trickle the bytes (`delay`), hold every
download after some bytes until the test opens a gate (`gate`, `gate_after`), send no ETag (`validators`), ignore
If-Range like an old server (`if_range`), send no Content-Length (`send_length`), or follow a file with `overrun`
more bytes than it has, without a Content-Length (a body that runs past the size a manifest declared; `sent` counts
the bytes the server got out before the client hung up)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, *, arch: str = "llama", pad_floats: int = 0, name: str = "tiny") -> Path:
    """A small but valid GGUF: metadata a loader reads (architecture, context, template) and a few tensors.

    `pad_floats` adds a float32 tensor of that many elements, to make a file big enough to interrupt mid-way."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(256)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_chat_template(CHATML)
    writer.add_license("mit")
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    if pad_floats:
        writer.add_tensor("output.weight", np.linspace(0, 1, pad_floats, dtype=np.float32).reshape(-1, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Hub:
    """What the server serves and how it misbehaves; `requests` logs (method, path, Range header)."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    drop_after: int | None = None
    drops_left: int = 0
    corrupt: bool = False
    delay: float = 0.0
    chunk: int = 64 * 1024
    gate: threading.Event | None = None
    gate_after: int = 0
    validators: bool = True
    if_range: bool = True
    send_length: bool = True
    overrun: int = 0
    sent: int = 0
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ranges(self) -> list[str | None]:
        """The Range headers of the file downloads, in order."""
        return [rng for method, path, rng in self.requests if method == "GET" and "/api/" not in path]

    def downloads_of(self, name: str) -> int:
        """How many GET requests asked for a file whose path ends with `name`."""
        return sum(1 for method, path, _ in self.requests if method == "GET" and path.endswith(name))


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    def do_GET(self) -> None:
        self._route(send_body=True)

    def _route(self, *, send_body: bool) -> None:
        self.hub.requests.append((self.command, self.path, self.headers.get("Range")))
        path = self.path.split("?", 1)[0]
        info = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?$", path)
        resolve = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path)
        if info:
            self._model_info(info.group(1))
        elif resolve and resolve.group(2) in self.hub.repos.get(resolve.group(1), {}):
            self._file(self.hub.repos[resolve.group(1)][resolve.group(2)], send_body)
        elif path.startswith("/files/") and path[7:] in self.hub.files:
            self._file(self.hub.files[path[7:]], send_body)
        else:
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"})

    def _model_info(self, repo: str) -> None:
        if repo not in self.hub.repos:
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return
        siblings = [
            {
                "rfilename": name,
                "size": len(data),
                "blobId": sha256_of(data)[:40],
                "lfs": {"size": len(data), "sha256": sha256_of(data), "pointerSize": 134},
            }
            for name, data in self.hub.repos[repo].items()
        ]
        body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings})
        self._send(200, body.encode(), {"Content-Type": "application/json"})

    def _file(self, data: bytes, send_body: bool) -> None:
        if self.hub.corrupt:
            data = bytes(reversed(data))
        start = 0
        etag = f'"{sha256_of(data)}"'
        match = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
        if_range = self.headers.get("If-Range")
        if match and self.hub.if_range and if_range is not None and if_range != etag:
            match = None  # RFC 9110: the file changed since the validator, so the whole file is sent
        headers = {"X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        if self.hub.validators:
            headers["ETag"] = etag
        if match:
            start = int(match.group(1))
            if start >= len(data):
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if self.hub.overrun and send_body:
            self._send_overrun(data[start:], headers)
            return
        self._send_stream(206 if match else 200, data[start:], headers, send_body, droppable=True)

    def _send_stream(
        self, status: int, body: bytes, headers: dict[str, str], send_body: bool, *, droppable: bool = False
    ) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if self.hub.send_length or not droppable:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")  # the body ends where the connection does
            self.close_connection = True
        self.end_headers()
        if not send_body:
            return
        drop = self._take_drop() if droppable else None
        sent = 0
        while sent < len(body):
            if droppable and self.hub.gate is not None and sent >= self.hub.gate_after:
                self.hub.gate.wait(timeout=120)
            if drop is not None and sent >= drop:
                self.close_connection = True
                self.connection.shutdown(2)  # mid-body: the client sees a connection closed early
                return
            piece = body[sent : sent + min(self.hub.chunk, (drop - sent) if drop is not None else self.hub.chunk)]
            try:
                self.wfile.write(piece)
            except (BrokenPipeError, ConnectionResetError):  # the client went away (a killed pull)
                self.close_connection = True
                return
            sent += len(piece)
            if self.hub.delay:
                time.sleep(self.hub.delay)

    def _send_overrun(self, body: bytes, headers: dict[str, str]) -> None:
        """`body` and then `overrun` zero bytes, made as they are sent, until the client hangs up."""
        self.send_response(200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        left = self.hub.overrun
        piece = body
        while piece:
            try:
                self.wfile.write(piece)
            except (BrokenPipeError, ConnectionResetError):
                return
            self.hub.sent += len(piece)
            piece = bytes(min(self.hub.chunk, left))
            left -= len(piece)

    def _take_drop(self) -> int | None:
        with self.hub.lock:
            if self.hub.drops_left <= 0:
                return None
            self.hub.drops_left -= 1
            return self.hub.drop_after

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self._send_stream(status, body, headers, send_body=True)


class HubServer:
    """`with HubServer(hub) as url:` serves `hub` on 127.0.0.1 at a free port until the block ends."""

    def __init__(self, hub: Hub):
        handler = type("Handler", (_Handler,), {"hub": hub})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
