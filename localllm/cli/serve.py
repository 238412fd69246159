"""`localllm serve`: the REST server (server/app.py) under uvicorn on LOCALLLM_HOST, with readable logs."""

from __future__ import annotations

import logging
import socket

from .. import config
from ..errors import LocalLLMError
from .app import app, console

_ENV_HELP = "Environment variables:\n\n" + "\n\n".join(
    f"  {line}" for line in config.describe().splitlines())


def _listen(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, so a busy port is a one-line error naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise LocalLLMError(f"cannot listen on {host}:{port}: {exc.strerror}",
                            hint="is another `localllm serve` running? set LOCALLLM_HOST to another address") from None
    return sock


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


@app.command(epilog=_ENV_HELP)
def serve() -> None:
    """Serve the Ollama and OpenAI APIs on LOCALLLM_HOST (default 127.0.0.1:11435)."""
    import uvicorn

    from ..server.app import create_app

    host, port = config.HOST.get()
    level = config.LOG_LEVEL.get()
    _configure_logging(level)
    sock = _listen(host, port)
    server = uvicorn.Server(uvicorn.Config(create_app(bound_host=host), log_level=level, access_log=False,
                                           timeout_graceful_shutdown=5))
    console.print(f"localllm is serving on {config.base_url() if host in ('0.0.0.0', '::') else _url(host, port)}"
                  " (Ctrl+C stops it)", highlight=False)
    server.run(sockets=[sock])


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
