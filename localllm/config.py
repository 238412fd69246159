"""Every LOCALLLM_* setting, in one place. Values are read lazily (each call reads the environment, so tests can
monkeypatch), each setting carries the one-line description that `localllm serve --help` prints, and a bad value is a
ConfigError naming the variable. Nothing is silently coerced."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    description: str
    parse: Callable[[str], T]
    default: Callable[[], T]

    def get(self) -> T:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default()
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{self.name}={raw!r} is not valid: {exc}") from None


def parse_bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def parse_positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("expected a whole number of at least 1")
    return value


_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(raw: str | int | float) -> float:
    """Ollama's keep_alive grammar: seconds as a number, or "10m", "1h", "30s"; negative means forever (inf).

    Returns seconds; 0 means unload as soon as the request finishes."""
    if isinstance(raw, (int, float)):
        seconds = float(raw)
    else:
        match = _DURATION.match(raw.strip())
        if not match:
            raise ValueError('expected a duration such as 300, "5m", "1h" or -1 for forever')
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return math.inf if seconds < 0 else seconds


def parse_host(raw: str) -> tuple[str, int]:
    """"host", "host:port", "[::1]:port" or "http://host:port" into (host, port)."""
    text = re.sub(r"^https?://", "", raw).rstrip("/")
    match = re.match(r"^\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?$|^(?P<h>[^:\[\]]*)(?::(?P<p>\d+))?$", text)
    if not match:
        raise ValueError('expected "host:port", for example 127.0.0.1:11435')
    host = match.group("v6") or match.group("h") or "127.0.0.1"
    port = int(match.group("p6") or match.group("p") or 11435)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is outside 0..65535")
    return host, port


def parse_list(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


MAX_RPC_WORKERS = 16  # GGML_RPC_MAX_SERVERS


def parse_endpoints(raw: str) -> list[str]:
    """RPC workers, "host:port,host:port" (IPv6 in brackets), each checked; duplicates dropped in order."""
    out: list[str] = []
    for item in parse_list(raw):
        host, sep, port = item.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port (for example 192.168.1.20:50052)")
        if item not in out:
            out.append(item)
    if len(out) > MAX_RPC_WORKERS:
        raise ValueError(f"{len(out)} workers; llama.cpp takes at most {MAX_RPC_WORKERS}")
    return out


def _default_home() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("localllm", appauthor=False))


def _default_parallel() -> int:
    # Four slots fit comfortably beside a small model on any machine we target; the KV cost is per slot and shown
    # by `localllm plan`, so a user with a big model lowers it knowingly.
    return 4


def _default_threads() -> int:
    # llama.cpp's throughput collapses when its threads outnumber the free cores (measured in docs/BENCHMARKS.md):
    # leave one core for the server and other work once there are few cores.
    cores = os.cpu_count() or 1
    return max(1, cores - 1) if cores <= 4 else max(1, cores // 2)


HOME = Setting("LOCALLLM_HOME", "where models and manifests live", lambda raw: Path(raw).expanduser(), _default_home)
HOST = Setting("LOCALLLM_HOST", "address the server binds and clients call (host:port)", parse_host,
               lambda: ("127.0.0.1", 11435))
NUM_PARALLEL = Setting("LOCALLLM_NUM_PARALLEL", "slots per loaded model: requests decoded at once", parse_positive_int,
                       _default_parallel)
MAX_QUEUE = Setting("LOCALLLM_MAX_QUEUE", "requests waiting for a slot before new ones get 503", parse_positive_int,
                    lambda: 64)
KEEP_ALIVE = Setting("LOCALLLM_KEEP_ALIVE", "how long an idle model stays loaded (300, 5m, 1h, -1 forever)",
                     parse_duration, lambda: 300.0)
MAX_LOADED_MODELS = Setting("LOCALLLM_MAX_LOADED_MODELS", "models kept loaded at once; the least recently used idle "
                            "one is unloaded", parse_positive_int, lambda: 3)
CONTEXT_LENGTH = Setting("LOCALLLM_CONTEXT_LENGTH", "default context per slot (num_ctx), in tokens",
                         parse_positive_int, lambda: 4096)
NUM_THREAD = Setting("LOCALLLM_NUM_THREAD", "CPU threads for decoding (default: leave a core free)",
                     parse_positive_int, _default_threads)
KV_CACHE_TYPE = Setting("LOCALLLM_KV_CACHE_TYPE", "KV cache type: f16, q8_0 or q4_0",
                        lambda raw: _one_of(raw, ("f16", "q8_0", "q4_0")), lambda: "f16")
FLASH_ATTENTION = Setting("LOCALLLM_FLASH_ATTENTION", "flash attention on/off (default: the backend decides)",
                          parse_bool, lambda: None)
ORIGINS = Setting("LOCALLLM_ORIGINS", "comma-separated origins allowed by CORS (none by default)", parse_list,
                  lambda: [])
ALLOWED_HOSTS = Setting("LOCALLLM_ALLOWED_HOSTS", "extra Host header names accepted besides loopback", parse_list,
                        lambda: [])
API_KEY = Setting("LOCALLLM_API_KEY", "bearer token required on every route but / and /health", str, lambda: "")
OFFLINE = Setting("LOCALLLM_OFFLINE", "never touch the network; a missing model is an error", parse_bool,
                  lambda: parse_bool(os.environ.get("HF_HUB_OFFLINE", "0") or "0"))
MAX_BODY = Setting("LOCALLLM_MAX_BODY", "largest request body in bytes (413 above it)", parse_positive_int,
                   lambda: 32 * 1024 * 1024)
RPC = Setting("LOCALLLM_RPC", "RPC workers (`localllm worker`) whose devices take layers of each model loaded: "
              "host:port[,host:port...]", lambda raw: parse_endpoints(raw), lambda: [])
LOG_LEVEL = Setting("LOCALLLM_LOG_LEVEL", "server log level: debug, info, warning, error",
                    lambda raw: _one_of(raw.lower(), ("debug", "info", "warning", "error")), lambda: "info")

ALL: tuple[Setting, ...] = (HOME, HOST, NUM_PARALLEL, MAX_QUEUE, KEEP_ALIVE, MAX_LOADED_MODELS, CONTEXT_LENGTH,
                            NUM_THREAD, KV_CACHE_TYPE, FLASH_ATTENTION, ORIGINS, ALLOWED_HOSTS, API_KEY, OFFLINE,
                            MAX_BODY, RPC, LOG_LEVEL)


def _one_of(raw: str, choices: tuple[str, ...]) -> str:
    if raw not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return raw


def models_dir() -> Path:
    return HOME.get() / "models"


def base_url() -> str:
    host, port = HOST.get()
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def describe() -> str:
    """The environment section of `localllm serve --help`."""
    return "\n".join(f"{s.name:<28} {s.description}" for s in ALL)
