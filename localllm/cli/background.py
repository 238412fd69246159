"""A server in the background, as Ollama's `run` does: when nothing answers on LOCALLLM_HOST, start `localllm serve`
as a detached process and wait until it answers, so a second `run`, the TUI or an IDE plugin reuse the loaded model.

The server outlives the command that started it (stop it with `kill $(cat LOCALLLM_HOME/server.pid)`); its output
goes to LOCALLLM_HOME/logs/server.log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .. import config
from ..errors import ServerUnreachable

START_TIMEOUT = 60.0  # seconds; the server answers before any model loads, so this covers a cold Python start only


def server_log_path() -> Path:
    return config.HOME.get() / "logs" / "server.log"


def server_pid_path() -> Path:
    return config.HOME.get() / "server.pid"


def ensure_server(*, timeout: float = START_TIMEOUT) -> str:
    """Return the base URL of a running server, starting one in the background first when none answers.

    Raises:
        ServerUnreachable: the started server exited or did not answer within `timeout`; the hint names its log.
    """
    from ..client.http import server_running

    url = config.base_url()
    if server_running(url):
        return url
    process = start_server()
    wait_for_server(url, process, timeout=timeout)
    return url


def start_server() -> subprocess.Popen:
    """Start `localllm serve` detached from this terminal (Ctrl-C here must not reach it) and record its pid."""
    log_path = server_log_path()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "localllm", "serve"], stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, env=_server_env(), **_detached())
    _write_pid(process.pid)
    return process


def wait_for_server(url: str, process: subprocess.Popen, *, timeout: float) -> None:
    from ..client.http import server_running

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server_running(url):
            return
        if process.poll() is not None:
            # Another `run` may have started a server at the same moment and won the port: that one will do.
            if server_running(url):
                return
            raise ServerUnreachable(f"the background server exited with code {process.returncode}: "
                                    f"{_last_line(server_log_path())}", hint=f"see {server_log_path()}")
        time.sleep(0.1)
    raise ServerUnreachable(f"the background server did not answer at {url} within {timeout:.0f}s",
                            hint=f"see {server_log_path()}")


def _server_env() -> dict[str, str]:
    # The child must not think it is attached to the terminal the user is chatting in.
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    return env


def _detached() -> dict[str, Any]:
    if sys.platform == "win32":
        flags = subprocess.CREATE_NEW_PROCESS_GROUP | subprocess.DETACHED_PROCESS  # type: ignore[attr-defined]
        return {"creationflags": flags}
    return {"start_new_session": True}


def _write_pid(pid: int) -> None:
    path = server_pid_path()
    temporary = path.with_suffix(".pid.tmp")
    temporary.write_text(f"{pid}\n", encoding="utf-8")
    os.replace(temporary, path)


def _last_line(path: Path) -> Optional[str]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return None
    return lines[-1] if lines else None
