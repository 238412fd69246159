"""`localllm serve` as a user runs it: a real process on a free loopback port, its help and its request log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from server_harness import free_port
from typer.testing import CliRunner

from localllm import config
from localllm.cli import app
from localllm.client.http import server_running


def test_help_lists_every_setting():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    for setting in config.ALL:
        assert setting.name in result.output


def test_serve_runs_and_logs_each_request(isolated_home):
    port = free_port()
    env = {**os.environ, "LOCALLLM_HOST": f"127.0.0.1:{port}", "LOCALLLM_HOME": str(isolated_home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "localllm", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not server_running(f"127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, "localllm serve did not come up"
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/api/tags").json() == {"models": []}
        busy = subprocess.run(
            [sys.executable, "-m", "localllm", "serve"], env=env, capture_output=True, text=True, timeout=60
        )
        assert busy.returncode == 1 and f"127.0.0.1:{port}" in busy.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}" in output
    assert "GET /api/tags 200" in output


def test_serve_beyond_loopback_needs_a_key(isolated_home):
    """Refused before anything binds: no socket is opened on the network."""
    env = {**os.environ, "LOCALLLM_HOST": f"0.0.0.0:{free_port()}", "LOCALLLM_HOME": str(isolated_home)}
    env.pop("LOCALLLM_API_KEY", None)
    refused = subprocess.run(
        [sys.executable, "-m", "localllm", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1
    assert "LOCALLLM_HOST 0.0.0.0 lets other machines reach this server" in refused.stderr
    assert "LOCALLLM_API_KEY" in refused.stderr


def test_serve_s_connections_send_small_writes_at_once():
    # Nagle's algorithm holds a stream's second small write (its opening event after the headers) until the client
    # ACKs the first, which Linux delays up to 40 ms: asyncio turns it off only where the socket says TCP.
    import asyncio
    import socket

    from localllm.cli.serve import _listen

    async def accepted_nodelay() -> int:
        found: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
                sock = transport.get_extra_info("socket")
                found.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        listener = _listen("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Accept, sock=listener)
        try:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            value = await asyncio.wait_for(found, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
