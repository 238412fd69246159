"""MLX served: `localllm serve` on an MLX model against `mlx_lm.server` at its defaults, on the very same converted
files, the same chat requests over /v1/chat/completions, one stream and four concurrent ones, interleaved."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .engine import FOUR_PROMPTS, LONG_STORY, EngineRun, concurrent_streams
from .figures import Bracketed, Figure
from .rest import free_port, http_client, served_model

MODEL = "bench-mlx"


def mlx_bench_home(gguf: Path, home: Path) -> Path:
    """Store `gguf` in `home` and create MODEL from it with `--format mlx`, as a user would; the MLX folder the
    store builds for it (the files both servers load)."""
    from ..api import CreateRequest
    from ..models.create import create_model
    from ..models.store import Store
    from .rest import create_bench_model

    create_bench_model(gguf, home, name="bench-gguf")
    store = Store(home / "models")
    list(create_model(CreateRequest(model=MODEL, **{"from": "bench-gguf"}, format="mlx"), store))
    return Path(store.resolve(MODEL).weights)


@contextmanager
def mlx_lm_server(folder: Path) -> Iterator[str]:
    """`mlx_lm.server` on `folder` with every setting at its default but the port; its base URL once it answers."""
    import httpx

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError("mlx_lm.server exited during start-up")
            try:
                httpx.get(f"{base}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mlx_lm.server did not answer within 300 s") from None
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def chat_run(base: str, model: str, prompts: list[str], n: int) -> EngineRun:
    """Stream each prompt as a user message through /v1/chat/completions at once, greedy, up to `n` tokens; every
    chunk that carries text counts as one token (both servers send one per token)."""

    def one(i: int, run: EngineRun) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompts[i]}],
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
        }
        with http_client().stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    run.received(i, [0])

    return concurrent_streams(EngineRun.start(len(prompts)), one)


def run_mlx_server_benchmarks(
    gguf: Path, *, n: int = 32, repeats: int = 3, log: Callable[[str], None] = print
) -> list[Figure]:
    """One stream and four through localllm serve and through mlx_lm.server, both up together on the same MLX files
    (the GGUF converted by `create --format mlx`), each run interleaved with the other's (Bracketed). `repeats`
    is kept low by default: MLX's CPU build decodes a few tokens a second, and each repeat is three runs."""
    note = f"same MLX files, /v1/chat/completions, greedy, up to {n} tokens; mlx_lm.server at its defaults"
    with tempfile.TemporaryDirectory(prefix="localllm-mlx-bench-") as tmp:
        home = Path(tmp)
        log("MLX served: converting the GGUF (create --format mlx)")
        folder = mlx_bench_home(gguf, home)
        with served_model(gguf, slots=4, threads=None, n_ctx=2048, home=home) as ours, mlx_lm_server(folder) as theirs:

            def measure(prompts: list[str]) -> Bracketed:
                return Bracketed.measure(
                    lambda: chat_run(theirs, "default_model", prompts, n).rate(),
                    lambda: chat_run(ours, MODEL, prompts, n).rate(),
                    repeats=repeats,
                )

            four = list(FOUR_PROMPTS)
            for base, model in ((ours, MODEL), (theirs, "default_model")):
                chat_run(base, model, four, 8)  # the first requests after a load pay for warm-up, not the serving
            log("MLX served: one stream")
            one = measure([LONG_STORY])
            log("MLX served: four streams")
            many = measure(four)
    return [
        one.figure("MLX single stream: ours vs mlx_lm.server", 0.95, note=note),
        many.figure("MLX 4 concurrent streams (aggregate): ours vs mlx_lm.server", 1.0, note=note),
    ]
