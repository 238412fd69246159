"""The RPC section of scripts/bench.py: what the hop to a `localllm worker` costs, local decode against the same model
with every layer on a worker over loopback (informational: loopback has no wire, so this is the protocol's floor)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from localllm.api import LoadOptions
from localllm.bench.engine import LONG_STORY, engine_run
from localllm.bench.figures import Figure
from localllm.bench.rest import free_port
from localllm.engine.runner import ModelEngine


def _start_worker(port: int, threads: int) -> subprocess.Popen:
    worker = subprocess.Popen(
        [sys.executable, "-m", "localllm", "worker", "--port", str(port), "--threads", str(threads)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise RuntimeError(f"`localllm worker` exited with {worker.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return worker
        except OSError:
            time.sleep(0.1)
    worker.kill()
    raise RuntimeError("`localllm worker` did not start listening")


def run_rpc_benchmarks(
    path: Path,
    *,
    n: int = 64,
    n_ctx: int = 1024,
    threads: int | None = None,
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> list[Figure]:
    """Single-stream decode, greedy, the same prompt: ours with every layer on a loopback worker (given the same
    threads) against ours on this machine alone; best of `repeats`, the two interleaved."""
    from localllm import config
    from localllm.backends import get_backend
    from localllm.machine import physical_cores

    threads = threads or config.NUM_THREAD.get() or physical_cores()
    port = free_port()
    log(f"RPC: a worker on 127.0.0.1:{port}")
    worker = _start_worker(port, threads)
    engines = {}
    try:
        for name, rpc in (("local", ""), ("rpc", f"127.0.0.1:{port}")):
            options = LoadOptions(num_thread=threads, num_ctx=n_ctx, num_parallel=1, rpc=rpc)
            engines[name] = ModelEngine(get_backend("llama.cpp").load(path, options), max_queue=1)
        prompt = engines["local"].tokenize(LONG_STORY)[:128]
        best = {name: 0.0 for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                log(f"RPC: {name} decode")
                best[name] = max(best[name], engine_run(engine, [prompt], n).rate())
    finally:
        for engine in engines.values():
            engine.close()
        worker.terminate()
        worker.wait(timeout=10)
    return [
        Figure(
            "decode with every layer on a loopback RPC worker",
            best["rpc"],
            best["local"],
            "tok/s",
            None,
            note=f"{threads} thread(s) on each side, {n} tokens; reference is the same engine on this "
            "machine alone; informational: the cost of the hop",
        )
    ]
