"""llama.cpp's RPC backend (ggml-rpc) and its device registry, through ctypes (llama-cpp-python binds llama.h only),
and the placement of a model's layers on those devices (place_model: the loader's and `localllm plan`'s).

A worker (`localllm worker`) is ggml's own RPC server over this machine's devices; a model load that names workers
(LOCALLLM_RPC, the `rpc` load option) registers each one's devices (ggml_backend_rpc_add_server, as llama.cpp's
`--rpc` does) and places layers on them. The functions are found as the RPC registry's proc addresses, as llama.cpp's
tools do, so a build with dynamically loaded backends works too.

ggml aborts the process when a worker cannot be reached or goes away (GGML_ABORT in the RPC dispatcher thread), and
its client has no timeouts: a worker that accepts and never answers blocks a call for good. The server must outlive
a worker, so: a worker is checked from Python (a TCP connect and the protocol's HELLO, with a deadline) before
llama.cpp is told of it; every native call that may reach a worker runs under RpcGuard, which gives up with WorkerLost
(503) when the call passes its deadline (LOCALLLM_RPC_TIMEOUT) or the worker is lost; and an abort callback parks the
failing native thread instead of letting abort() run and records the loss. What that thread held (the model's
buffers on the worker, the dead connection) stays allocated: such a model is abandoned, never freed.

llama.cpp keeps one connection per address string for as long as a buffer holds it, so the abandoned model keeps the
dead one under that string for good. A worker that is back is reached under a new spelling of its address (a
leading zero in the port, which llama.cpp's parser reads as the same port): the next load uses it again."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import llama_cpp
import psutil

from ...api import LoadOptions
from ...errors import BackendUnavailable, InvalidInput, ModelFormatError, WorkerLost
from ...models.plan import (
    DeviceKind,
    DeviceReport,
    Placement,
    available_memory,
    host_report,
    place_layers,
    plan_memory,
    unplanned_placement,
)
from ...quant.gguf import inspect_gguf

log = logging.getLogger(__name__)
T = TypeVar("T")

REBUILD_COMMAND = "bash scripts/setup.sh"
# --no-cache-dir: pip caches the wheel by the sdist, not by CMAKE_ARGS, and would reinstall the build without RPC.
REBUILD_PIP = (
    f'CMAKE_ARGS="-DGGML_RPC=ON" {sys.executable} -m pip install --force-reinstall --no-deps '
    f"--no-cache-dir --no-binary llama-cpp-python llama-cpp-python=={llama_cpp.__version__}"
)
PROBE_SECONDS = 3.0
_RPC_CMD_HELLO = 14  # ggml-rpc.cpp: static_assert(RPC_CMD_HELLO == 14)
_RPC_CAPS = 24  # RPC_CONN_CAPS_SIZE (transport.h)
_RPC_HELLO_ANSWER = 4 + _RPC_CAPS  # rpc_msg_hello_rsp
_DEV_TYPES: dict[int, DeviceKind] = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def supports_rpc() -> bool:
    return bool(llama_cpp.llama_supports_rpc())


def require_rpc() -> None:
    if not supports_rpc():
        raise BackendUnavailable(
            "this llama-cpp-python was built without llama.cpp's RPC backend",
            hint=f"rebuild it: `{REBUILD_COMMAND}` (or `{REBUILD_PIP}`)",
        )


# ---------------------------------------------------------------------------------------------------------- ggml


class _Ggml:
    """The few ggml-backend functions we need, from the libraries llama_cpp already loaded (dlopen shares them)."""

    def __init__(self) -> None:
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        self._libs = [
            ctypes.CDLL(str(path))
            for stem in ("ggml-base", "ggml", "ggml-rpc")
            for path in _library_files(lib_dir, stem)[:1]
        ]
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.dev_count = self._fn("ggml_backend_dev_count", sz, [])
        self.dev_get = self._fn("ggml_backend_dev_get", vp, [sz])
        self.dev_name = self._fn("ggml_backend_dev_name", ctypes.c_char_p, [vp])
        self.dev_description = self._fn("ggml_backend_dev_description", ctypes.c_char_p, [vp])
        self.dev_memory = self._fn("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
        self.dev_type = self._fn("ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_backend_reg = self._fn("ggml_backend_dev_backend_reg", vp, [vp])
        self.reg_name = self._fn("ggml_backend_reg_name", ctypes.c_char_p, [vp])
        self.reg_by_name = self._fn("ggml_backend_reg_by_name", vp, [ctypes.c_char_p])
        self.reg_dev_count = self._fn("ggml_backend_reg_dev_count", sz, [vp])
        self.reg_dev_get = self._fn("ggml_backend_reg_dev_get", vp, [vp, sz])
        self.reg_proc = self._fn("ggml_backend_reg_get_proc_address", vp, [vp, ctypes.c_char_p])
        self.register = self._fn("ggml_backend_register", None, [vp])
        self.set_abort_callback = self._fn("ggml_set_abort_callback", vp, [vp])
        self.print_backtrace = self._fn("ggml_print_backtrace", None, [])

    def _fn(self, name: str, restype, argtypes):
        for lib in self._libs:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
                return fn
        raise BackendUnavailable(
            f"llama-cpp-python's ggml libraries lack {name}", hint=f"rebuild it: `{REBUILD_COMMAND}`"
        )

    def rpc_proc(self, name: str, prototype):
        reg = self.reg_by_name(b"RPC")
        address = self.reg_proc(reg, name.encode()) if reg else None
        if not address:
            require_rpc()
            raise BackendUnavailable(
                f"llama.cpp's RPC backend does not offer {name}", hint=f"rebuild it: `{REBUILD_COMMAND}`"
            )
        return prototype(address)

    def kind(self, dev: int) -> DeviceKind:
        reg = self.dev_backend_reg(dev)
        return "rpc" if reg and self.reg_name(reg) == b"RPC" else _DEV_TYPES.get(self.dev_type(dev), "gpu")

    def report(self, dev: int) -> DeviceReport:
        """Asks the device for its free memory: for an RPC device, a round trip to its worker."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return DeviceReport(
            name=self.dev_name(dev).decode(),
            description=self.dev_description(dev).decode(),
            kind=self.kind(dev),
            free=free.value,
            total=total.value,
        )


def _library_files(lib_dir: Path, stem: str) -> list[Path]:
    """The file the loader mapped for libllama first: its soname (libggml.so.0). A wheel holds the unversioned name
    as a copy, not a link, and loading that copy would give a second ggml with registries and callbacks of its own."""
    patterns = {"win32": [f"{stem}.dll"], "darwin": [f"lib{stem}.*.dylib", f"lib{stem}.dylib"]}.get(
        sys.platform, [f"lib{stem}.so.[0-9]*", f"lib{stem}.so"]
    )
    for pattern in patterns:
        found = sorted(lib_dir.glob(pattern), key=lambda p: len(p.name))
        if found:
            return found[:1]
    return []


_ggml: _Ggml | None = None
_ggml_lock = threading.Lock()


def ggml() -> _Ggml:
    global _ggml
    with _ggml_lock:
        if _ggml is None:
            _ggml = _Ggml()
        return _ggml


@dataclass(frozen=True)
class Device:
    """A ggml device: its report for placement, and its handle for llama_model_params.devices."""

    report: DeviceReport
    handle: int


def local_devices() -> list[Device]:
    """This machine's offload devices (GPUs, integrated GPUs), in ggml's order; never the CPU or an RPC worker."""
    g = ggml()
    # Kinds first: asking a registered worker's device for its memory would reach that worker, maybe a lost one.
    handles = [h for h in (g.dev_get(i) for i in range(g.dev_count())) if g.kind(h) in ("gpu", "igpu")]
    return [Device(g.report(h), h) for h in handles]


# ---------------------------------------------------------------------------------------------------------- workers


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"RPC worker {text!r} is not host:port", hint="for example 192.168.1.20:50052")
    return host, int(port)


def reach(endpoint: str) -> str:
    """The spelling of `endpoint` to give llama.cpp, once a worker there has answered; WorkerLost (503) naming it
    when nothing listens, or when it accepts and does not answer HELLO within PROBE_SECONDS."""
    host, port = parse_endpoint(endpoint)
    with _registered_lock:
        spelling = _spellings.get(endpoint, endpoint)
        lost = spelling in _losses.endpoints
        # A worker serves one client at a time: while a model of ours holds its connection, HELLO would wait.
        first_contact = lost or spelling not in _registered
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS) as sock:
            if first_contact:
                _hello(sock)
    except TimeoutError:
        raise WorkerLost(
            f"the RPC worker at {endpoint} accepted a connection but did not answer within {PROBE_SECONDS:.0f} s",
            hint="it is stalled, or serving another client (a worker serves one at a time); restart it",
        ) from None
    except OSError as exc:
        raise WorkerLost(
            f"cannot reach the RPC worker at {endpoint}: {exc.strerror or exc}",
            hint=f"start one there: `localllm worker --host {host} --port {port}`",
        ) from None
    if lost:
        with _registered_lock:
            spelling = _spellings[endpoint] = _respelled(spelling)
        log.warning("the RPC worker at %s is back: models load with it again (as %s)", endpoint, spelling)
    return spelling


def _hello(sock: socket.socket) -> None:
    """ggml-rpc's handshake: command 14 (HELLO) with 24 bytes of transport capabilities (none asked); the answer is
    its size (8 bytes), then major, minor, patch, padding and 24 bytes of capabilities."""
    sock.sendall(bytes([_RPC_CMD_HELLO]) + struct.pack("<Q", _RPC_CAPS) + bytes(_RPC_CAPS))
    answer = b""
    while len(answer) < 8 + _RPC_HELLO_ANSWER:
        chunk = sock.recv(8 + _RPC_HELLO_ANSWER - len(answer))
        if not chunk:
            raise OSError("the worker closed the connection during the handshake")
        answer += chunk
    if struct.unpack_from("<Q", answer)[0] != _RPC_HELLO_ANSWER:
        raise OSError("the worker answered the handshake with an unknown protocol (another llama.cpp version?)")


def _respelled(spelling: str) -> str:
    host, _, port = spelling.rpartition(":")
    return f"{host}:0{port}"


def plain_endpoint(spelling: str) -> str:
    """The address as the user wrote it, for messages: without the leading zeros of a new spelling."""
    host, _, port = spelling.rpartition(":")
    return f"{host}:{int(port)}" if port.isdigit() else spelling


def worker_devices(spellings: Sequence[str]) -> list[Device]:
    """Register each worker's devices with ggml (once per address, as llama.cpp's --rpc does) and return them.
    `spellings` come from `reach`."""
    if not spellings:
        return []
    require_rpc()
    install_abort_guard()
    g = ggml()
    add_server = g.rpc_proc("ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
    devices: list[Device] = []
    for spelling in spellings:
        with _registered_lock:
            _known.add(spelling)
        reg = RpcGuard.once(spellings, add_server, spelling.encode())
        if not reg:
            raise WorkerLost(f"the RPC worker at {plain_endpoint(spelling)} offers no devices")
        with _registered_lock:
            if spelling not in _registered:
                g.register(reg)
                _registered.add(spelling)
        for handle in [g.reg_dev_get(reg, i) for i in range(g.reg_dev_count(reg))]:
            devices.append(Device(RpcGuard.once(spellings, g.report, handle), handle))  # a round trip to the worker
    return devices


_known: set[str] = set()  # every address llama.cpp was told of: where a loss can be
_registered: set[str] = set()
_spellings: dict[str, str] = {}  # an address as the user gives it -> the spelling llama.cpp knows it by now
_registered_lock = threading.Lock()


def serve_worker(host: str, port: int, *, threads: int, cache_dir: str | None) -> None:
    """Run ggml's RPC server on this machine's devices (accelerators, else the CPU) until the process ends."""
    require_rpc()
    g = ggml()
    every = [g.dev_get(i) for i in range(g.dev_count())]
    chosen = [h for h in every if g.kind(h) in ("gpu", "igpu")] or [h for h in every if g.kind(h) == "cpu"][:1]
    if not chosen:
        raise BackendUnavailable("ggml reports no device to serve")
    start = g.rpc_proc(
        "ggml_backend_rpc_start_server",
        ctypes.CFUNCTYPE(
            None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)
        ),
    )
    handles = (ctypes.c_void_p * len(chosen))(*chosen)
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # ggml's accept loop never returns to Python, so Python's handlers would never run: Ctrl+C and SIGTERM end the
    # process as they end llama.cpp's rpc-server.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.flush()  # nothing Python buffered would be written once ggml holds the process
    sys.stderr.flush()
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, len(chosen), handles)
    # ggml returns only when it could not start (it has printed why): a busy port, a bad address.
    raise WorkerLost(
        f"llama.cpp's RPC server could not listen on {endpoint}", hint="is the port in use? choose another with --port"
    )


# ---------------------------------------------------------------------------------------------------------- placement


class PlacedModel:
    """A placement and the ggml devices it names (offload devices in its order), for llama_model_params."""

    def __init__(self, placement: Placement, devices: list[Device], endpoints: list[str]):
        self.placement = placement
        by_name = {d.report.name: d for d in devices}
        self.devices = [by_name[share.device.name] for share in placement.offload]
        self.endpoints = endpoints


def rpc_endpoints(options: LoadOptions) -> list[str]:
    from ... import config

    # None: no workers (LOCALLLM_RPC was applied by models/options.effective_load).
    return config.parse_endpoints(options.rpc) if options.rpc else []


def place_model(path: Path, options: LoadOptions, *, n_seq: int, n_ctx: int) -> PlacedModel:
    """The one placement both the loader and `localllm plan` use: this machine's GPUs and the RPC workers' devices
    (first, as llama.cpp orders them), by their free memory and the memory plan."""

    try:
        endpoints = rpc_endpoints(options)
    except ValueError as exc:
        raise InvalidInput(f"option rpc: {exc}") from None
    reached, gone = _reach_all(endpoints)
    if gone and _named_by_request(options):
        raise next(iter(gone.values()))
    if gone:
        return _placed_without(path, options, gone, n_seq=n_seq, n_ctx=n_ctx)
    return _placed_on(path, options, reached, n_seq=n_seq, n_ctx=n_ctx)


def _named_by_request(options: LoadOptions) -> bool:
    """Workers a request (or Modelfile) names are required; the server's own (LOCALLLM_RPC) may be done without."""
    from ... import config

    return bool(options.rpc) and options.rpc != ",".join(config.RPC.get())


def _reach_all(endpoints: Sequence[str]) -> tuple[list[str], dict[str, WorkerLost]]:
    reached, gone = [], {}
    for endpoint in endpoints:
        try:
            reached.append(reach(endpoint))
        except WorkerLost as exc:
            gone[endpoint] = exc
    return reached, gone


def _placed_without(
    path: Path, options: LoadOptions, gone: dict[str, WorkerLost], *, n_seq: int, n_ctx: int
) -> PlacedModel:
    """A load whose workers are not all there runs on this machine alone when the model fits here (the user gets
    answers, slower ones); otherwise the 503 naming the first missing worker. The pool loads it again with the
    workers once they answer (workers_back)."""
    local = _placed_on(path, options, [], n_seq=n_seq, n_ctx=n_ctx)
    if not local.placement.fits:
        raise next(iter(gone.values()))
    names = tuple(gone)
    log.warning(
        "%s runs on this machine alone while the RPC worker(s) at %s cannot be reached (%s); it loads with them "
        "again once they answer",
        path.name,
        ", ".join(names),
        "; ".join(str(exc) for exc in gone.values()),
    )
    placement = replace(local.placement, missing_workers=names)
    return PlacedModel(placement, local.devices, [])


def workers_back(endpoints: Sequence[str]) -> bool:
    """Whether every worker in `endpoints` accepts a connection and answers HELLO again."""
    return all(_answers(endpoint) for endpoint in endpoints)


def _answers(endpoint: str) -> bool:
    try:
        with socket.create_connection(parse_endpoint(endpoint), timeout=1.0) as sock:
            sock.settimeout(PROBE_SECONDS)
            _hello(sock)
    except (OSError, InvalidInput):
        return False
    return True


def _placed_on(path: Path, options: LoadOptions, endpoints: list[str], *, n_seq: int, n_ctx: int) -> PlacedModel:
    devices = worker_devices(endpoints) + local_devices()
    reports = [d.report for d in devices]
    try:
        mem = plan_memory(
            inspect_gguf(path),
            options.model_copy(update={"num_ctx": n_ctx, "num_parallel": n_seq, "kv_type": options.kv_type or "f16"}),
        )
    except ModelFormatError as exc:  # llama.cpp may still load it: let it place the layers
        log.warning("no memory plan for %s (%s): llama.cpp splits the layers by free memory", path.name, exc)
        host = DeviceReport(name="CPU", description="", kind="cpu", free=available_memory() or 0, total=0)
        return PlacedModel(unplanned_placement(host, reports, options.num_gpu), devices, endpoints)
    placement = place_layers(mem, host_report(mem), reports, options.num_gpu)
    if not placement.fits:
        log.warning(
            "%s may not fit: %s",
            path.name,
            "; ".join(
                f"{s.device.name} needs {s.total / 2**20:.0f} MiB of {s.device.usable / 2**20:.0f} MiB usable"
                for s in placement.shares
                if not s.fits
            ),
        )
    return PlacedModel(placement, devices, endpoints)


# ---------------------------------------------------------------------------------------------------------- aborts


class _Losses:
    """Workers lost in this process: set by the abort callback (any thread), read by RpcGuard."""

    def __init__(self) -> None:
        self.endpoints: set[str] = set()
        self.message = ""
        self.changed = threading.Event()

    def record(self, endpoints: Sequence[str], message: str) -> None:
        self.endpoints.update(endpoints)
        self.message = message
        self.changed.set()


_losses = _Losses()
_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_abort_guard = None
_RPC_ABORTS = ("Remote RPC server crashed", "Failed to connect to", "RPC handshake failed")


def _on_abort(message: bytes | None) -> None:
    text = (message or b"").decode("utf-8", "replace")
    if not any(marker in text for marker in _RPC_ABORTS):
        sys.stderr.write(text + "\n")  # what ggml does by default; abort() follows
        sys.stderr.flush()
        ggml().print_backtrace()
        return
    with _registered_lock:
        known = sorted(_known)
    unreachable = [e for e in known if not _reachable(e)]
    _losses.record(unreachable or known, text.split(": ", 1)[-1])
    log.error(
        "RPC worker lost (%s): %s; the models placed there fail their requests and are abandoned",
        ", ".join(plain_endpoint(e) for e in unreachable or known) or "unknown",
        _losses.message,
    )
    threading.Event().wait()  # park this native thread for good: returning would abort() the whole server


def _reachable(endpoint: str) -> bool:
    try:
        socket.create_connection(parse_endpoint(endpoint), timeout=1.0).close()
        return True
    except OSError:
        return False


def sever(endpoints: Sequence[str]) -> None:
    """Shut down this process's connections to `endpoints`. A worker serves one client at a time, so a stalled
    worker that resumes would go on serving the abandoned model's connection for good; shut, it fails that client
    and accepts the next load. The native thread blocked on it wakes into ggml's abort path, which parks it."""
    addresses = {address for endpoint in endpoints for address in _addresses(endpoint)}
    try:
        connections = psutil.Process().net_connections(kind="tcp")
    except psutil.Error as exc:
        log.warning("cannot list this process's connections to shut the lost worker's: %s", exc)
        return
    for conn in connections:
        if conn.fd < 0 or not conn.raddr or (conn.raddr.ip, conn.raddr.port) not in addresses:
            continue
        try:
            with socket.socket(fileno=os.dup(conn.fd)) as sock:  # the duplicate shares the connection
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed meanwhile


def _addresses(endpoint: str) -> set[tuple[str, int]]:
    host, port = parse_endpoint(endpoint)
    try:
        return {(str(info[4][0]), port) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return {(host, port)}


def install_abort_guard() -> None:
    global _abort_guard
    with _ggml_lock:
        if _abort_guard is None:
            _abort_guard = _ABORT_CALLBACK(_on_abort)  # kept referenced: ggml holds the pointer for good
    ggml().set_abort_callback(ctypes.cast(_abort_guard, ctypes.c_void_p))


class RpcGuard:
    """Runs a model's native calls on a thread of its own while the model uses RPC workers, so that the caller
    (the engine thread) can give up with WorkerLost when a worker it uses is lost mid-call, or when the call passes
    its deadline (llama.cpp's client waits on a silent worker for good); the native thread stays blocked in
    llama.cpp and the model is abandoned (`lost`)."""

    def __init__(self, endpoints: Sequence[str]):
        self.endpoints = tuple(endpoints)
        self.lost = False
        self._calls: queue.SimpleQueue[tuple[Future, Callable, tuple, dict] | None] = queue.SimpleQueue()
        # A daemon thread, not an executor's: a thread left blocked in llama.cpp must not hold up the exit.
        threading.Thread(target=self._serve, name="localllm-rpc", daemon=True).start()

    @classmethod
    def once(cls, endpoints: Sequence[str], fn: Callable[..., T], *args) -> T:
        guard = cls(endpoints)
        try:
            return guard.call(fn, *args)
        finally:
            guard.close()

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the native thread, within LOCALLLM_RPC_TIMEOUT."""
        from ... import config

        return self.call_within(config.RPC_TIMEOUT.get(), fn, *args, **kwargs)

    def call_within(self, seconds: float, fn: Callable[..., T], *args, **kwargs) -> T:
        self._check()
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        deadline = time.monotonic() + seconds
        while True:
            done, _ = wait([future], timeout=0.25)
            if done:
                return future.result()
            self._check()
            if time.monotonic() > deadline:
                self._give_up(seconds)

    def _give_up(self, seconds: float) -> None:
        self.lost = True
        names = ", ".join(plain_endpoint(e) for e in self.endpoints)
        _losses.record(self.endpoints, f"no answer within {seconds:.0f} s")
        sever(self.endpoints)
        log.error("RPC worker %s did not answer within %.0f s: the model placed there is abandoned", names, seconds)
        raise WorkerLost(
            f"the RPC worker at {names} did not answer within {seconds:.0f} s (LOCALLLM_RPC_TIMEOUT)",
            hint="check or restart the worker; the next request after it answers again loads the model with it",
        )

    def _check(self) -> None:
        lost = [e for e in self.endpoints if e in _losses.endpoints]
        if self.lost or lost:
            self.lost = True
            names = ", ".join(plain_endpoint(e) for e in lost) or "an address"
            raise WorkerLost(
                f"the RPC worker at {names} went away ({_losses.message or 'connection lost'})",
                hint="restart the worker: the next request after it is back loads the model with it again",
            )

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn, args, kwargs = item
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, like an executor would
                future.set_exception(exc)

    def close(self) -> None:
        self._calls.put(None)
