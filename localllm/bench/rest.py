"""The REST path: `localllm serve` in a subprocess against the raw loop, and beside another server."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp

from .engine import FOUR_PROMPTS, LONG_STORY, EngineRun, concurrent_streams
from .figures import BRACKET_REPEATS, Bracketed, Figure
from .raw import RawLoop, raw_batched_rate, raw_decode_rate

if TYPE_CHECKING:
    import httpx


@cache
def http_client() -> httpx.Client:
    """One client for every streamed request the benchmarks time, ours and llama-server's alike. A new httpx client
    builds an SSL context (milliseconds), which the top-level httpx.stream did inside every timed request; a
    client keeps one, as IDE plugins and SDKs do. No keep-alive: each request still opens its own connection."""
    import httpx

    return httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    """A loopback port nothing listens on now, for a server the benchmark starts."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served_model(
    path: Path,
    *,
    slots: int | None,
    threads: int | None,
    n_ctx: int | None,
    home: Path | None = None,
    env: dict[str, str] | None = None,
    projector: Path | None = None,
) -> Iterator[str]:
    """`localllm serve` in a subprocess over a home that holds `path` as model "bench:latest" (with `projector` as
    its vision projector): a private one, or `home` (kept, so a second server on it is a restart), with `env`'s
    settings on top. Yields once the model has loaded and the flash attention trial its first load starts in the
    background has ended: the figures are of a model this machine already knows, as a user's is from its second
    load on (the first load has a section of its own), not of a server sharing its cores with that trial."""
    import tempfile

    if home is None:
        with tempfile.TemporaryDirectory(prefix="localllm-bench-") as private:
            with served_model(
                path, slots=slots, threads=threads, n_ctx=n_ctx, home=Path(private), env=env, projector=projector
            ) as base:
                yield base
        return
    import os
    import subprocess
    import sys

    import httpx

    port = free_port()
    settings = {
        **os.environ,
        "LOCALLLM_HOME": str(home),
        "LOCALLLM_HOST": f"127.0.0.1:{port}",
        "LOCALLLM_LOG_LEVEL": "warning",
        **(env or {}),
    }
    if slots:  # None: the server's default slot count
        settings["LOCALLLM_NUM_PARALLEL"] = str(slots)
    if n_ctx:  # None: the server's default, the model's trained context
        settings["LOCALLLM_CONTEXT_LENGTH"] = str(n_ctx)
    if threads:
        settings["LOCALLLM_NUM_THREAD"] = str(threads)
    proc = subprocess.Popen(
        [sys.executable, "-m", "localllm", "serve"], env=settings, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(base, proc)
        create_bench_model(path, home, projector)
        started = time.perf_counter()
        httpx.post(f"{base}/api/generate", json={"model": "bench", "prompt": ""}, timeout=300)  # load it
        SERVED_PIDS[base], FIRST_LOADS[base] = proc.pid, time.perf_counter() - started
        wait_for_trials(home)
        yield base
    finally:
        SERVED_PIDS.pop(base, None)
        FIRST_LOADS.pop(base, None)
        proc.terminate()
        proc.wait(timeout=60)


def wait_for_trials(home: Path, timeout: float = 300) -> None:
    """Until every probe memory in `home` says its flash attention trial has run (or `timeout` seconds)."""
    from ..backends.llama_cpp.probe import trial_pending

    probes = home / "models" / "probes"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(trial_pending(entry) for entry in (probes.glob("*") if probes.is_dir() else [])):
            return
        time.sleep(0.5)


# Of each server served_model runs: its process (for its memory) and how long its first load took (the load
# request on the client's clock), seconds.
SERVED_PIDS: dict[str, int] = {}
FIRST_LOADS: dict[str, float] = {}


def create_bench_model(
    path: Path, home: Path, projector: Path | None = None, *, name: str = "bench", parameters: dict | None = None
) -> None:
    """Store `path` in `home` as model `name` (with `projector`, and Modelfile `parameters`), as a pull leaves it.

    The weights' blob is a hard link to `path` where the file system allows, named to create_model by digest (no
    copy is written): the server maps the very file llama-server maps, not a fresh copy whose pages slow each
    request's first decode (docs/benchmark-notes.md, "The served model's weights")."""
    from ..api import CreateRequest
    from ..models.create import create_model
    from ..models.store import Store

    store = Store(home / "models")
    hashing = store.blobs.add_reference(Path(path))
    while True:
        try:
            next(hashing)
        except StopIteration as added:
            digest = added.value
            break
    request = CreateRequest(
        model=name,
        projector=str(projector) if projector else None,
        parameters=parameters or {},
        files={"bench.gguf": digest},
    )
    list(create_model(request, store))


def _wait_until_up(base: str, proc) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("localllm serve exited during start-up")
        try:
            httpx.get(f"{base}/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("localllm serve did not answer within 60 s")


def rest_run(base: str, prompts: list[list[int]], n: int) -> EngineRun:
    """Stream raw-token prompts through /api/generate concurrently; the client's clock, as an IDE plugin sees it."""
    import json

    def one(i: int, run: EngineRun) -> None:
        body = {
            "model": "bench",
            "prompt": "",
            "context": prompts[i],
            "raw": True,
            "stream": True,
            "options": {"temperature": 0, "num_predict": n, "spec_type": "none", "ignore_eos": True},
        }
        with http_client().stream("POST", f"{base}/api/generate", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                chunk = json.loads(line)
                if chunk.get("tokens"):
                    run.received(i, chunk["tokens"])

    return concurrent_streams(EngineRun.start(len(prompts)), one)


def run_rest_benchmarks(
    path: Path,
    *,
    n: int = 128,
    n_ctx: int = 4096,
    threads: int | None = None,
    repeats: int = 3,
    other_server: Callable[[list[list[int]], int], ContextManager[OtherServer]] | None = None,
    log: Callable[[str], None] = print,
) -> list[Figure]:
    """One stream and four streams through the REST server against the raw loop (single and batched) at the same
    thread count: one stream the best of `repeats` runs interleaved with the raw loop's, four streams Bracketed.
    `other_server(prompts, n)` starts another server for the same four streams (llama.cpp's llama-server -np 4) and
    yields its name and a function that measures one run of them; ours is Bracketed by its runs too."""
    from .. import config
    from ..chat.templates import render_chat
    from ..machine import physical_cores

    threads = threads or config.NUM_THREAD.get() or physical_cores()
    loop = RawLoop(path, n_ctx=n_ctx, threads=1)
    template = llama_cpp.llama_model_chat_template(loop.model, None)

    def render(text: str) -> list[int]:
        return loop.tokenize(render_chat(template.decode() if template else None, [{"role": "user", "content": text}]))

    story, four = render(LONG_STORY), [render(p) for p in FOUR_PROMPTS]
    loop.close()
    raw1 = one = 0.0
    repeats_four = max(repeats, BRACKET_REPEATS)
    with (
        served_model(path, slots=4, threads=threads, n_ctx=n_ctx) as base,
        other_server(four, n) if other_server else nullcontext() as other,
    ):

        def ours_four() -> float:
            return rest_run(base, four, n).rate()

        rest_run(base, four, 8)  # the first requests after a load pay for warm-up, not the REST path
        for i in range(repeats):
            log(f"REST: raw loop and localllm serve, one stream, repeat {i + 1}/{repeats}")
            raw1 = max(raw1, raw_decode_rate(path, story, n, threads=threads, n_ctx=n_ctx)[0])
            one = max(one, rest_run(base, [story], n).rate())
        log("REST: raw loop and localllm serve, four streams")
        many = Bracketed.measure(
            lambda: raw_batched_rate(path, four, n, threads=threads, n_ctx=n_ctx), ours_four, repeats=repeats_four
        )
        versus = None
        if other is not None:
            log(f"REST: {other.name} and localllm serve, four streams")
            versus = Bracketed.measure(other.measure, ours_four, repeats=repeats_four)
    same = f"at the same {threads} thread(s); the client's clock, after every stream's first token"
    figures = [
        Figure("REST single stream", one, raw1, "tok/s", 0.97, note=f"raw loop {same}"),
        many.figure("REST 4 concurrent streams (aggregate)", 1.0, note=f"raw batched loop {same}"),
    ]
    if versus is not None and other is not None:
        figures.append(
            versus.figure(
                f"REST 4 concurrent streams: ours vs {other.name}",
                1.0,
                note=f"same prompt tokens, greedy, EOS ignored, both {same}",
            )
        )
    return figures


@dataclass
class OtherServer:
    """Another server up beside ours for a side-by-side figure: `measure()` runs the four streams once, tok/s."""

    name: str
    measure: Callable[[], float]
