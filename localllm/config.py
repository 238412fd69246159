"""Every LOCALLLM_* setting, in one place. Values are read lazily (each call reads the environment, so tests can
monkeypatch), each setting carries the one-line description that `localllm serve --help` prints, and a bad value is a
ConfigError naming the variable. Nothing is silently coerced."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

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


# Go's time.ParseDuration, as Ollama reads keep_alive: "300ms", "5m", "1h30m", "-1s"; a bare number is seconds.
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_DURATION_PART = re.compile(rf"({_NUMBER})(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(rf"([-+]?)((?:{_NUMBER}(?:ns|us|µs|μs|ms|s|m|h))+|{_NUMBER})")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


# A keep_alive longer than this is forever: an expiry that far off would not fit a datetime, and nobody means it.
MAX_DURATION = 100 * 365 * 86400.0


def parse_duration(raw: str | int | float) -> float:
    """Ollama's keep_alive grammar: seconds as a number, or a Go duration ("10m", "1h30m", "500ms"); negative means
    forever (inf), and so does anything longer than a hundred years.

    Returns seconds; 0 means unload as soon as the request finishes."""
    if isinstance(raw, bool):
        raise ValueError('expected a duration such as 300, "5m", "1h30m" or -1 for forever, not true/false')
    if isinstance(raw, (int, float)):
        try:
            seconds = float(raw)
        except OverflowError:  # an integer too large for a float
            seconds = math.inf
    else:
        seconds = _go_duration(raw.strip())
    if math.isnan(seconds):
        raise ValueError("expected a number of seconds, not NaN")
    return math.inf if seconds < 0 or seconds > MAX_DURATION else seconds


def _go_duration(text: str) -> float:
    match = _DURATION.fullmatch(text)
    if not match:
        raise ValueError('expected a duration such as 300, "5m", "1h30m" or -1 for forever')
    sign, body = match.groups()
    parts = _DURATION_PART.findall(body)
    seconds = sum(float(n) * _UNIT_SECONDS[unit] for n, unit in parts) if parts else float(body)
    return -seconds if sign == "-" else seconds


def parse_host(raw: str) -> tuple[str, int]:
    """ "host", "host:port", "[::1]:port" or "http://host:port" into (host, port)."""
    text = re.sub(r"^https?://", "", raw).rstrip("/")
    match = re.match(r"^\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?$|^(?P<h>[^:\[\]]*)(?::(?P<p>\d+))?$", text)
    if not match:
        raise ValueError('expected "host:port", for example 127.0.0.1:11435')
    host = match.group("v6") or match.group("h") or "127.0.0.1"
    port = int(match.group("p6") or match.group("p") or 11435)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is outside 0..65535")
    return host, port


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)$", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(raw: str) -> int:
    """A size in bytes: 0, 1048576, "512MiB", "2GB", "8g" (k/m/g/t count in 1024s, as llama-server's --cache-ram
    counts MiB)."""
    match = _SIZE.match(raw.strip())
    if not match:
        raise ValueError("expected a size such as 0, 512MiB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * 1024 ** _SIZE_POWER[match.group(2).lower()])


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


def parse_registry(raw: str) -> str:
    """An Ollama-style registry's base URL: http(s)://host[:port], no path (`http` is refused later unless the host
    is loopback or the pull says --insecure)."""
    match = re.match(r"^(https?)://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(:\d{1,5})?/?$", raw)
    if not match:
        raise ValueError("expected a URL such as https://registry.ollama.ai (scheme, host and port only)")
    return raw.rstrip("/").lower()


def _default_home() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("localllm", appauthor=False))


def _default_parallel() -> int:
    # Four slots fit comfortably beside a small model on any machine we target; the KV cost is per slot and shown
    # by `localllm plan`, so a user with a big model lowers it knowingly.
    return 4


def parse_threads(raw: str) -> int | None:
    """A fixed thread count, or `auto` (None): the engine chooses the count as it runs (engine/threads.py)."""
    return None if raw.strip().lower() == "auto" else parse_positive_int(raw)


HOME = Setting("LOCALLLM_HOME", "where models and manifests live", lambda raw: Path(raw).expanduser(), _default_home)
HOST = Setting(
    "LOCALLLM_HOST",
    "address the server binds and clients call (host:port); beyond loopback only with LOCALLLM_API_KEY",
    parse_host,
    lambda: ("127.0.0.1", 11435),
)
NUM_PARALLEL = Setting(
    "LOCALLLM_NUM_PARALLEL", "slots per loaded model: requests decoded at once", parse_positive_int, _default_parallel
)
MAX_QUEUE = Setting(
    "LOCALLLM_MAX_QUEUE",
    "requests waiting for a slot, and requests waiting for a model to load, before new ones get 503",
    parse_positive_int,
    lambda: 64,
)
LOAD_TIMEOUT = Setting(
    "LOCALLLM_LOAD_TIMEOUT",
    "how long a request waits for its model to load, or for busy models to finish before one reloads with other "
    "load options or unloads to make room (300, 5m); past it a 503 says what it waited for",
    lambda raw: _positive_duration(raw),
    lambda: 300.0,
)
KEEP_ALIVE = Setting(
    "LOCALLLM_KEEP_ALIVE",
    "how long an idle model stays loaded (300, 5m, 1h, -1 forever)",
    parse_duration,
    lambda: 300.0,
)
MAX_LOADED_MODELS = Setting(
    "LOCALLLM_MAX_LOADED_MODELS",
    "models kept loaded at once; the least recently used idle one is unloaded",
    parse_positive_int,
    lambda: 3,
)
CONTEXT_LENGTH: Setting[int | None] = Setting(
    "LOCALLLM_CONTEXT_LENGTH",
    "default context per slot (num_ctx), in tokens (default: what the model was trained for, as far as a quarter of "
    "this machine's memory holds its KV pool; `localllm plan MODEL` shows it)",
    parse_positive_int,
    lambda: None,
)
NUM_THREAD = Setting(
    "LOCALLLM_NUM_THREAD",
    "CPU threads for decoding: a number pins it; auto (the default) runs on the physical cores (within a "
    "cgroup's CPU budget) and on fewer only while other processes hold some of them",
    parse_threads,
    lambda: None,
)
KV_CACHE_TYPE = Setting(
    "LOCALLLM_KV_CACHE_TYPE",
    "KV cache type: f16, q8_0 or q4_0",
    lambda raw: _one_of(raw, ("f16", "q8_0", "q4_0")),
    lambda: "f16",
)
FLASH_ATTENTION = Setting(
    "LOCALLLM_FLASH_ATTENTION", "flash attention on/off (default: the backend decides)", parse_bool, lambda: None
)
DETERMINISTIC = Setting(
    "LOCALLLM_DETERMINISTIC",
    "every request in deterministic mode (options.deterministic): the same request answers the same text every "
    "time, at the cost of running alone, without prefix reuse or speculation",
    parse_bool,
    lambda: False,
)
QUALITY_TOKENS = Setting(
    "LOCALLLM_QUALITY_TOKENS",
    "tokens of built-in text a quantization's quality report compares (0: no report)",
    lambda raw: _bounded_int(raw, 0, 8192),
    lambda: 2048,
)
ORIGINS = Setting(
    "LOCALLLM_ORIGINS",
    "comma-separated web origins (globs like chrome-extension://*) allowed to call "
    "the server and by CORS; loopback pages always may call",
    parse_list,
    lambda: [],
)
ALLOWED_HOSTS = Setting(
    "LOCALLLM_ALLOWED_HOSTS", "extra Host header names accepted besides loopback", parse_list, lambda: []
)
API_KEY = Setting("LOCALLLM_API_KEY", "bearer token required on every route but / and /health", str, lambda: "")
OFFLINE = Setting(
    "LOCALLLM_OFFLINE",
    "never touch the network; a missing model is an error",
    parse_bool,
    lambda: parse_bool(os.environ.get("HF_HUB_OFFLINE", "0") or "0"),
)
REGISTRY = Setting(
    "LOCALLLM_REGISTRY",
    "the Ollama-style registry that names without a host are pulled from (a URL)",
    parse_registry,
    lambda: "https://registry.ollama.ai",
)
PULL_TIMEOUT = Setting(
    "LOCALLLM_PULL_TIMEOUT",
    "seconds a registry manifest may take to arrive whole; a download that brings under 1 MiB in that long is "
    "stopped (resumable), so a server that drips bytes never holds a pull forever (30, 2m)",
    lambda raw: _positive_duration(raw),
    lambda: 120.0,
)
MAX_BODY = Setting(
    "LOCALLLM_MAX_BODY", "largest request body in bytes (413 above it)", parse_positive_int, lambda: 32 * 1024 * 1024
)
RPC = Setting(
    "LOCALLLM_RPC",
    "RPC workers (`localllm worker`) whose devices take layers of each model loaded: host:port[,host:port...]",
    lambda raw: parse_endpoints(raw),
    lambda: [],
)
RPC_TIMEOUT = Setting(
    "LOCALLLM_RPC_TIMEOUT",
    "seconds an RPC worker may take to answer one call (a decode step; a load gets this plus its transfer time)",
    lambda raw: float(_bounded_int(raw, 1, 3600)),
    lambda: 60.0,
)
LOG_LEVEL = Setting(
    "LOCALLLM_LOG_LEVEL",
    "server log level: debug, info, warning, error",
    lambda raw: _one_of(raw.lower(), ("debug", "info", "warning", "error")),
    lambda: "info",
)
RESPONSES_MAX = Setting(
    "LOCALLLM_RESPONSES_MAX",
    "stored /v1/responses kept for previous_response_id; the oldest go first",
    parse_positive_int,
    lambda: 1000,
)
RESPONSES_MAX_AGE = Setting(
    "LOCALLLM_RESPONSES_MAX_AGE",
    "how long a stored /v1/responses answer is kept (seconds, or 30m, 168h; -1 forever)",
    parse_duration,
    lambda: 30 * 24 * 3600.0,
)

KV_POOL = Setting(
    "LOCALLLM_KV_POOL",
    "KV cache tokens a model's slots share, so one long conversation uses what short ones leave "
    "(default num_ctx, as llama-server's unified cache; num_ctx x slots gives each slot cells of its own)",
    parse_positive_int,
    lambda: 0,
)
CACHE_RAM = Setting(
    "LOCALLLM_CACHE_RAM",
    "host RAM per loaded model for prompt prefixes evicted from the slots (512MiB, 2GiB; 0 off; default "
    "an eighth of free memory shared by LOCALLLM_MAX_LOADED_MODELS, at most 8GiB)",
    parse_size,
    lambda: None,
)
CACHE_DISK = Setting(
    "LOCALLLM_CACHE_DISK",
    "disk per model (under LOCALLLM_HOME/cache) for prompt prefixes, kept across restarts "
    "(4GiB; 0 off; default a twentieth of the free disk, at most 4GiB)",
    parse_size,
    lambda: None,
)
INFILL_MODEL = Setting(
    "LOCALLLM_INFILL_MODEL",
    "the model /infill uses when a request names none (llama.vscode and llama.vim name none)",
    str,
    lambda: "qwen2.5-coder:0.5b",
)
MCP_CONFIG = Setting(
    "LOCALLLM_MCP_CONFIG",
    "the mcp.json that names the MCP servers the chats may use (default LOCALLLM_HOME/mcp.json)",
    lambda raw: Path(raw).expanduser(),
    lambda: HOME.get() / "mcp.json",
)
MCP = Setting(
    "LOCALLLM_MCP",
    "serve the web page's MCP tool routes for mcp.json's servers (as `serve --mcp`; off by default)",
    parse_bool,
    lambda: False,
)

ALL: tuple[Setting, ...] = (
    HOME,
    HOST,
    NUM_PARALLEL,
    MAX_QUEUE,
    LOAD_TIMEOUT,
    KEEP_ALIVE,
    MAX_LOADED_MODELS,
    CONTEXT_LENGTH,
    NUM_THREAD,
    KV_CACHE_TYPE,
    KV_POOL,
    FLASH_ATTENTION,
    DETERMINISTIC,
    QUALITY_TOKENS,
    ORIGINS,
    ALLOWED_HOSTS,
    API_KEY,
    OFFLINE,
    REGISTRY,
    PULL_TIMEOUT,
    MAX_BODY,
    RPC,
    RPC_TIMEOUT,
    LOG_LEVEL,
    CACHE_RAM,
    CACHE_DISK,
    RESPONSES_MAX,
    RESPONSES_MAX_AGE,
    INFILL_MODEL,
    MCP_CONFIG,
    MCP,
)


def _bounded_int(raw: str, low: int, high: int) -> int:
    value = int(raw)
    if not low <= value <= high:
        raise ValueError(f"expected a whole number from {low} to {high}")
    return value


def _positive_duration(raw: str) -> float:
    seconds = parse_duration(raw)
    if not 0 < seconds < math.inf:
        raise ValueError('expected a duration above zero, such as 30, "2m" or 0.5')
    return seconds


def _one_of(raw: str, choices: tuple[str, ...]) -> str:
    if raw not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return raw


def models_dir() -> Path:
    return HOME.get() / "models"


def prefix_cache_dir() -> Path:
    return HOME.get() / "cache" / "prefix"


def responses_dir() -> Path:
    """Where stored /v1/responses answers live."""
    return HOME.get() / "responses"


def base_url() -> str:
    host, port = HOST.get()
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def home_id() -> str:
    """A fingerprint of LOCALLLM_HOME, reported on /health: a client can tell whether a server serves its own home
    without the server publishing the path."""
    import hashlib

    return hashlib.sha256(str(HOME.get().resolve()).encode("utf-8")).hexdigest()[:16]


def describe() -> str:
    """The environment section of `localllm serve --help`."""
    return "\n".join(f"{s.name:<28} {s.description}" for s in ALL)
