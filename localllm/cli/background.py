"""A server in the background, as Ollama's `run` does: when nothing answers on LOCALLLM_HOST, start `localllm serve`
as a detached process and wait until it answers, so a second `run`, the TUI or an IDE plugin reuse the loaded model.

The server outlives the command that started it: the command says so once, and `localllm serve --status` / `--stop`
show and stop it (its pid is in LOCALLLM_HOME/server.pid, its output in LOCALLLM_HOME/logs/server.log). A pid file
whose process is gone is removed wherever it is met.

A server answering on LOCALLLM_HOST is used only when it serves this LOCALLLM_HOME (its /health reports a fingerprint
of the home): another home's server has other models, and `run` would chat with the wrong ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .. import config
from ..errors import ServerConflict, ServerUnreachable

START_TIMEOUT = 60.0  # seconds; the server answers before any model loads, so this covers a cold Python start only


def server_log_path() -> Path:
    return config.HOME.get() / "logs" / "server.log"


def server_pid_path() -> Path:
    return config.HOME.get() / "server.pid"


STOP_TIMEOUT = 10.0  # seconds a server gets to finish its requests after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class ServerHealth:
    """What a server's /health says about it; `home` and `pid` are None for a server that does not report them
    (an older localllm, or Ollama itself)."""

    url: str
    home: str | None
    pid: int | None

    @property
    def ours(self) -> bool:
        return self.home is None or self.home == config.home_id()


def server_health(url: str) -> ServerHealth | None:
    """The /health of the server at `url`, or None when nothing answers there."""
    from ..client.http import server_running

    try:
        response = httpx.get(url + "/health", timeout=2.0)
        body = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        body = None
    if not isinstance(body, dict):
        return ServerHealth(url, None, None) if server_running(url) else None
    pid = body.get("pid")
    home = body.get("home")
    return ServerHealth(url, home if isinstance(home, str) else None, pid if isinstance(pid, int) else None)


def ensure_server(*, timeout: float = START_TIMEOUT, on_start: Callable[[str], None] | None = None) -> str:
    """Return the base URL of a running server for this LOCALLLM_HOME, starting one in the background first when
    none answers; `on_start(url)` is called when one is started (to say so once).

    Raises:
        ServerConflict: the server on LOCALLLM_HOST serves another LOCALLLM_HOME.
        ServerUnreachable: the started server exited or did not answer within `timeout`; the hint names its log.
    """
    url = config.base_url()
    health = server_health(url)
    if health is not None:
        check_same_home(health)
        return url
    remove_stale_pid_file()
    process = start_server()
    wait_for_server(url, process, timeout=timeout)
    if on_start is not None:
        on_start(url)
    return url


def check_same_home(health: ServerHealth) -> None:
    if not health.ours:
        raise ServerConflict(
            f"the localllm server at {health.url} serves another LOCALLLM_HOME, not {config.HOME.get()}",
            hint="set LOCALLLM_HOST to a free address (e.g. 127.0.0.1:11436) to start a server for "
            "this home, or use --in-process",
        )


def started_notice(url: str) -> str:
    return (
        f"started a localllm server in the background at {url}; it keeps models loaded after this command. "
        f"Stop it with `localllm serve --stop` (log: {server_log_path()})"
    )


# ---------------------------------------------------------------------------------------------------------- pid file


def read_pid_file() -> int | None:
    try:
        return int(server_pid_path().read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


def remove_stale_pid_file() -> bool:
    """Remove server.pid when its process is gone (killed, crashed, machine restarted); True if removed."""
    pid = read_pid_file()
    if server_pid_path().exists() and (pid is None or not process_alive(pid)):
        server_pid_path().unlink(missing_ok=True)
        return True
    return False


def process_alive(pid: int) -> bool:
    if sys.platform == "win32":  # there os.kill(pid, 0) would terminate the process
        import ctypes

        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)  # type: ignore[attr-defined]
        if handle:
            ctypes.windll.kernel32.CloseHandle(handle)  # type: ignore[attr-defined]
        return bool(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's: not ours to signal
        return True
    except OSError:
        return False
    return True


def stop_background_server(pid: int, *, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM (the server finishes or cancels its requests and unloads), then SIGKILL after `timeout`; the pid file
    goes either way."""
    for sig, wait in ((signal.SIGTERM, timeout), (getattr(signal, "SIGKILL", signal.SIGTERM), 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and process_alive(pid):
            time.sleep(0.1)
        if not process_alive(pid):
            break
    server_pid_path().unlink(missing_ok=True)


def start_server() -> subprocess.Popen:
    """Start `localllm serve` detached from this terminal (Ctrl-C here must not reach it) and record its pid."""
    log_path = server_log_path()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "localllm", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_server_env(),
            **_detached(),
        )
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
            raise ServerUnreachable(
                f"the background server exited with code {process.returncode}: {_last_line(server_log_path())}",
                hint=f"see {server_log_path()}",
            )
        time.sleep(0.1)
    raise ServerUnreachable(
        f"the background server did not answer at {url} within {timeout:.0f}s", hint=f"see {server_log_path()}"
    )


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


def _last_line(path: Path) -> str | None:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return None
    return lines[-1] if lines else None
