"""Helpers for the server tests: the real app under real uvicorn in a background thread on a free loopback port."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

SYSTEM = "You are a helpful AI assistant."
# smollm2:135m with speculation off: the draft window is sized from measured step costs, so with speculation a greedy
# answer follows the machine's load; pinned, the tests that compare answers between requests hold on a busy machine.
PINNED = "pinned:1"
SMALL = {"temperature": 0, "num_predict": 12}


def free_port() -> int:
    """A loopback port free now (the OS picked it; nothing holds it after this returns)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve `app` on 127.0.0.1:<free port>; yields the base URL and stops the server on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # as `localllm serve` binds
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Set LOCALLLM_* variables for a whole module's server (module fixtures cannot use `monkeypatch`)."""
    patch = pytest.MonkeyPatch()
    for name, value in values.items():
        patch.setenv(name, value)
    try:
        yield
    finally:
        patch.undo()


def local_client(home: Path):
    """A LocalClient on `home`: the shared, read-only test home, or one of a test's own."""
    from localllm.client.local import LocalClient
    from localllm.models.store import Store

    return LocalClient(store=Store(home / "models"))


def private_home(models_home: Path, target: Path) -> Path:
    """A home of our own holding the catalog models, for tests that pull, copy, create or delete: manifests are
    copied, blobs hard-linked (or copied across devices), so the shared cache is never changed."""
    src, dst = models_home / "models", target / "models"
    shutil.copytree(src / "manifests", dst / "manifests")
    (dst / "blobs").mkdir(parents=True)
    for blob in (src / "blobs").iterdir():
        if blob.is_file():
            try:
                os.link(blob, dst / "blobs" / blob.name)
            except OSError:
                shutil.copy2(blob, dst / "blobs" / blob.name)
    _copy_probes(src, dst)
    return target


def _copy_probes(src: Path, dst: Path) -> None:
    if (src / "probes").is_dir():  # the same blobs on the same machine: their load probes (and trials) hold here too
        shutil.copytree(src / "probes", dst / "probes")


def linked_home(models_home: Path, home: Path) -> Path:
    """A home of its own whose blobs link to the session's catalog models (so nothing shared is changed)."""
    shutil.copytree(models_home / "models" / "manifests", home / "models" / "manifests")
    blobs = home / "models" / "blobs"
    blobs.mkdir()
    for blob in (models_home / "models" / "blobs").iterdir():
        if blob.name.startswith("sha256-") and blob.is_file():
            os.symlink(blob, blobs / blob.name)
    _copy_probes(models_home / "models", home / "models")
    return home


@contextmanager
def served(home: Path, **settings: str) -> Iterator[str]:
    """The real app over a LocalClient on `home` (the shared test home, or a private_home), with these LOCALLLM_*
    settings; yields its URL."""
    from localllm.server.app import create_app

    with env(**settings):
        client = local_client(home)
        try:
            with serve_in_thread(create_app(client)) as url:
                yield url
        finally:
            client.close()


def with_pinned_model(home: Path) -> Path:
    """`home` (a private one) with PINNED created in it."""
    from localllm import api

    client = local_client(home)
    try:
        for _ in client.create(api.CreateRequest(model=PINNED, from_="smollm2:135m", parameters={"spec_type": "none"})):
            pass
    finally:
        client.close()
    return home


@contextmanager
def pinned_server(models_home: Path, target: Path, **settings: str) -> Iterator[str]:
    """A server on a private home with PINNED, one decode thread (the tuner's count follows the load too)."""
    home = with_pinned_model(private_home(models_home, target))
    with served(home, LOCALLLM_NUM_THREAD="1", **settings) as url:
        yield url
