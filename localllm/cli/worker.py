"""`localllm worker`: lend this machine's devices to another machine's localllm, through llama.cpp's RPC server.

The protocol has no authentication and no encryption: anyone who can reach the port can run code on the devices and
read what they hold. So it binds loopback unless told otherwise, and says so loudly when it is."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import typer

from .app import app, console, err_console

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command()
def worker(
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="address to bind; anything but loopback is reachable by others, with no authentication",
    ),
    port: int = typer.Option(DEFAULT_PORT, "--port", min=1, max=65535, help="port to bind"),
    threads: int | None = typer.Option(
        None, "--threads", min=1, max=1024, help="CPU threads when serving the CPU (default: LOCALLLM_NUM_THREAD)"
    ),
    cache_dir: Path | None = typer.Option(
        None,
        "--cache-dir",
        help="keep received weights here, so a model loads faster the next time (llama.cpp's rpc-server --cache)",
    ),
) -> None:
    """Lend this machine's GPUs (or CPU) to a localllm elsewhere, over RPC.

    On the other machine: LOCALLLM_RPC=this-host:PORT."""
    from .. import config
    from ..backends import require_rpc, serve_rpc_worker
    from ..machine import physical_cores

    require_rpc()
    if not _is_loopback(host):
        err_console.print(
            f"[bold red]!!! WARNING: the RPC worker listens on {host}:{port}, beyond this machine.[/]\n"
            "[bold red]!!! llama.cpp's RPC protocol has no authentication and no encryption: anyone who can reach "
            "this port can use these devices and read what they hold. Never expose it to an open network; bind a "
            "private interface behind a firewall.[/]",
            highlight=False,
        )
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    console.print(
        f"localllm worker on {host}:{port} (Ctrl+C stops it); on the other machine: LOCALLLM_RPC={host}:{port}",
        highlight=False,
    )
    serve_rpc_worker(
        host,
        port,
        threads=threads or config.NUM_THREAD.get() or physical_cores(),
        cache_dir=str(cache_dir) if cache_dir is not None else None,
    )
