"""Backend registry. Backends import lazily so that an optional one that is not installed fails with the install
hint only when it is chosen."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import BackendUnavailable, InvalidInput
from ..models.plan import KvQuantization
from .base import Backend


def get_backend(name: str) -> Backend:
    if name == "llama.cpp":
        from .llama_cpp.checked import CheckedLlamaCppBackend

        return CheckedLlamaCppBackend()
    if name == "mlx":
        try:
            from .mlx import MlxBackend
        except ImportError as exc:
            raise BackendUnavailable(
                f"the MLX backend needs mlx and mlx-lm ({exc.name} is missing)", hint="pip install 'localllm[mlx]'"
            ) from None
        return MlxBackend()
    raise InvalidInput(f"unknown backend {name!r}", hint="use auto, llama.cpp or mlx")


def mlx_load_facts(kv_type: str | None, config: dict) -> tuple[int | None, KvQuantization | None]:
    """What an MLX load does to memory, for the plan: the bytes per float weight once loaded (None: as stored) and
    the KV quantization `kv_type` gets (backends/mlx/backend.py); BackendUnavailable where mlx is not installed."""
    get_backend("mlx")
    from .mlx.backend import float_bytes_on_load, kv_quant

    return float_bytes_on_load(), kv_quant(kv_type, config)


def serve_rpc_worker(host: str, port: int, *, threads: int, cache_dir: str | None) -> None:
    """This machine's devices for other processes' llama.cpp loads (`localllm worker`), until the process ends."""
    from .llama_cpp import rpc

    rpc.serve_worker(host, port, threads=threads, cache_dir=cache_dir)


def require_rpc() -> None:
    """BackendUnavailable, with the rebuild hint, where llama.cpp was built without its RPC backend."""
    from .llama_cpp import rpc

    rpc.require_rpc()


def workers_back(endpoints: Sequence[str]) -> bool:
    """Whether the RPC workers at `endpoints` (a placement's missing_workers) answer again."""
    from .llama_cpp import rpc

    return rpc.workers_back(endpoints)


def load_check_memory(models_root: Path) -> Path:
    """The folder backends keep what their load checks found in (Backend.check): in the store, once per home."""
    return models_root / "probes"


def choose_backend(requested: str, weights: Path) -> str:
    """auto: an MLX folder (config.json + safetensors) runs on mlx, anything else on llama.cpp."""
    if requested != "auto":
        return requested
    return "mlx" if weights.is_dir() else "llama.cpp"
