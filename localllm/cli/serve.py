"""`localllm serve`: the REST server (server/app.py) under uvicorn on LOCALLLM_HOST, with readable logs; and
`serve --status` / `serve --stop` for the server that `run` and `tui` start in the background (cli/background.py)."""

from __future__ import annotations

import logging
import socket

import typer

from .. import config
from ..errors import LocalLLMError
from .app import app, console, err_console

_ENV_HELP = "Environment variables:\n\n" + "\n\n".join(f"  {line}" for line in config.describe().splitlines())


def _listen(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, so a busy port is a one-line error naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on connections whose socket says TCP, and with it
    # on, a stream's second small write (the opening event after the headers) waits for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise LocalLLMError(
            f"cannot listen on {host}:{port}: {exc.strerror}",
            hint="is another `localllm serve` running? set LOCALLLM_HOST to another address",
        ) from None
    return sock


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


@app.command(epilog=_ENV_HELP)
def serve(
    status: bool = typer.Option(
        False,
        "--status",
        help="say whether a server runs on LOCALLLM_HOST, where, and how to stop it (exit 1 when none does)",
    ),
    stop: bool = typer.Option(False, "--stop", help="stop the server that `run` or `tui` started in the background"),
    mcp: bool = typer.Option(False, "--mcp", help="let the web page use the tools of mcp.json's MCP servers"),
) -> None:
    """Serve the Ollama and OpenAI APIs (--status, --stop).

    Listens on LOCALLLM_HOST (default 127.0.0.1:11435) until Ctrl+C."""
    if status and stop:
        raise typer.BadParameter("use --status or --stop, not both")
    if status:
        _status()
    elif stop:
        _stop()
    else:
        _serve(mcp=mcp or None)


def _status() -> None:
    from .background import remove_stale_pid_file, server_health, server_log_path, server_pid_path

    if remove_stale_pid_file():
        err_console.print(f"removed {server_pid_path()}: its server is no longer running", highlight=False)
    url = config.base_url()
    health = server_health(url)
    if health is None:
        console.print(f"no localllm server is running at {url}", highlight=False)
        raise typer.Exit(1)
    pid = f" (pid {health.pid})" if health.pid is not None else ""
    if not health.ours:
        console.print(
            f"a localllm server{pid} runs at {url}, for another LOCALLLM_HOME than {config.HOME.get()}", highlight=False
        )
        raise typer.Exit(1)
    console.print(f"localllm server running at {url}{pid}, serving {config.HOME.get()}", highlight=False)
    if _background_pid(health.pid) is not None:
        console.print(f"started in the background; log: {server_log_path()}", highlight=False)
        console.print("stop it with `localllm serve --stop`", highlight=False)
    else:
        console.print(
            "started with `localllm serve`: stop it with Ctrl+C in its terminal"
            + (f" or `kill {health.pid}`" if health.pid is not None else ""),
            highlight=False,
        )


def _stop() -> None:
    from .background import remove_stale_pid_file, server_health, server_pid_path, stop_background_server

    if remove_stale_pid_file():
        err_console.print(f"removed {server_pid_path()}: its server is no longer running", highlight=False)
    url = config.base_url()
    health = server_health(url)
    pid = _background_pid(health.pid if health is not None else None)
    if pid is not None:
        stop_background_server(pid)
        console.print(f"stopped the localllm server at {url} (pid {pid})", highlight=False)
    elif health is not None and health.ours:
        raise LocalLLMError(
            f"the server at {url} was not started in the background by `run` or `tui`",
            hint="stop it with Ctrl+C in its terminal" + (f" or `kill {health.pid}`" if health.pid is not None else ""),
        )
    else:
        console.print(f"no background localllm server is running for {config.HOME.get()}", highlight=False)


def _background_pid(reported: int | None) -> int | None:
    """The pid in server.pid when it is the server answering (never signal a pid the server does not confirm:
    after a reboot the number may belong to anything)."""
    from .background import read_pid_file

    pid = read_pid_file()
    return pid if pid is not None and pid == reported else None


def _serve(*, mcp: bool | None = None) -> None:
    import uvicorn

    from ..server.app import create_app

    host, port = config.HOST.get()
    _require_key_beyond_loopback(host)
    level = config.LOG_LEVEL.get()
    _configure_logging(level)
    sock = _listen(host, port)
    served = create_app(bound_host=host, mcp=mcp)
    server = uvicorn.Server(uvicorn.Config(served, log_level=level, access_log=False, timeout_graceful_shutdown=5))
    console.print(
        f"localllm is serving on {config.base_url() if host in ('0.0.0.0', '::') else _url(host, port)}"
        " (Ctrl+C stops it)",
        highlight=False,
    )
    server.run(sockets=[sock])


def _require_key_beyond_loopback(host: str) -> None:
    """A server other machines reach serves the models, the store and the web page to them: only with a key."""
    from ..server.security import is_loopback_host

    if not is_loopback_host(host) and not config.API_KEY.get():
        raise LocalLLMError(
            f"LOCALLLM_HOST {host} lets other machines reach this server, and no LOCALLLM_API_KEY is set",
            hint="set LOCALLLM_API_KEY (clients send it as a bearer token), or bind 127.0.0.1 and reach it through"
            " an SSH tunnel",
        )


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
