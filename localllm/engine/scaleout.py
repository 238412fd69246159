"""Devices for the surfaces, which never import a backend: where a model's layers would go (`localllm plan`) and
llama.cpp's RPC server (`localllm worker`)."""

from __future__ import annotations

from .. import api, backends
from ..backends import choose_backend, get_backend
from ..models.options import effective_load
from ..models.plan import Placement
from ..models.store import ResolvedModel


def placement(model: ResolvedModel, load: api.LoadOptions) -> Placement | None:
    """What the loader would do now with these options: the same function, the same devices' free memory."""
    load = effective_load(load)
    backend = get_backend(choose_backend(load.backend, model.weights))
    return backend.placement(model.weights, load)


def serve_worker(host: str, port: int, *, threads: int, cache_dir: str | None) -> None:
    """Serve this machine's devices to other localllm (or llama.cpp) processes until the process ends."""
    backends.serve_rpc_worker(host, port, threads=threads, cache_dir=cache_dir)


def require_rpc() -> None:
    backends.require_rpc()
