"""Three benchmark sections against llama-server (scripts/bench.py):

- embeddings: 256 short texts in one /v1/embeddings request, ours against llama-server --embeddings at its defaults,
  on the same GGUF (`--models nomic-embed-text --only embed --llama-server PATH`);
- reranking: 64 documents in one /v1/rerank request, ours against llama-server --rerank, on the synthetic
  cross-encoder the tests score (tests/rerank_model.py; `--only rerank --llama-server PATH`: no model is pulled);
- bandwidth: one stream's decode at 1 thread and at every core as a share of the read bandwidth as many threads
  measure (model bytes x tok/s / GB/s), ours and llama-server's (`--models qwen2.5-coder:1.5b --only bandwidth`)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from localllm.bench import rest
from localllm.bench.figures import Bracketed, Figure

N_TEXTS = 256
_SUBJECTS = ("cat", "river", "invoice", "compiler", "violin", "glacier", "tax form", "garden", "satellite", "bakery")
_VERBS = ("explains", "hides", "measures", "follows", "repairs", "describes", "remembers", "carries")
_OBJECTS = ("the morning light", "a broken clock", "three old maps", "the quarterly report", "a quiet song")


def short_texts(n: int = N_TEXTS) -> list[str]:
    """Deterministic short documents (8 to 12 words), with nomic's document prefix as a client would send it."""
    return [f"search_document: The {_SUBJECTS[i % 10]} {_VERBS[i % 8]} {_OBJECTS[i % 5]} (note {i})." for i in range(n)]


# ------------------------------------------------------------------------------------------------------- servers


@contextmanager
def llama_server(binary: str, path: Path, *extra: str) -> Iterator[str]:
    """llama-server at its defaults on a free loopback port (plus `extra` flags); yields its base URL."""
    import httpx

    port = rest.free_port()
    command = [binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with status {proc.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become ready")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _embed_rate(base: str, model: str, texts: list[str]) -> tuple[float, list[list[float]]]:
    """Texts per second for one /v1/embeddings request of all `texts`, and the vectors."""
    started = time.perf_counter()
    reply = rest.http_client().post(
        f"{base}/v1/embeddings", json={"model": model, "input": texts, "encoding_format": "float"}
    )
    elapsed = time.perf_counter() - started
    reply.raise_for_status()
    data = sorted(reply.json()["data"], key=lambda d: d["index"])
    return len(texts) / elapsed, [d["embedding"] for d in data]


# ------------------------------------------------------------------------------------------------------- embeddings


def embed_figures(
    path: Path, *, llama_server_binary: str | None, repeats: int = 3, log: Callable[[str], None] = print
) -> list[Figure]:
    if not llama_server_binary:
        log(
            "no llama-server binary (LLAMA_SERVER=$(bash scripts/build_llama_server.sh)): "
            "the embeddings section needs it"
        )
        return []
    texts = short_texts()
    with (
        rest.served_model(path, slots=1, threads=None, n_ctx=2048) as ours,
        llama_server(llama_server_binary, path, "--embeddings") as theirs,
    ):
        _embed_rate(ours, "bench", texts[:8])  # warm-up: the embedding context is made on first use
        _embed_rate(theirs, "bench", texts[:8])
        ours_vectors: list[list[float]] = []
        theirs_vectors: list[list[float]] = []

        def mine() -> float:
            rate, vectors = _embed_rate(ours, "bench", texts)
            ours_vectors[:] = vectors
            return rate

        def reference() -> float:
            rate, vectors = _embed_rate(theirs, "bench", texts)
            theirs_vectors[:] = vectors
            return rate

        log(f"embeddings: {N_TEXTS} short texts, llama-server --embeddings and localllm serve, {repeats} repeats")
        run = Bracketed.measure(reference, mine, repeats=repeats)
    agreement = min(
        float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(ours_vectors, theirs_vectors)
    )
    figure = run.figure(
        f"{N_TEXTS} short texts through /v1/embeddings: ours vs llama-server --embeddings",
        0.97,
        note=f"one request of all texts, both servers at their defaults; lowest cosine between the two servers' "
        f"vectors {agreement:.4f}",
    )
    figure.unit = "texts/s"
    return [figure]


# ------------------------------------------------------------------------------------------------------- reranking

N_DOCUMENTS = 64
RERANK_QUERY = "what does the cat explain in the garden"


def _rerank_rate(base: str, model: str, documents: list[str]) -> tuple[float, dict[int, float]]:
    """Documents per second for one /v1/rerank request of all `documents`, and each one's score."""
    started = time.perf_counter()
    reply = rest.http_client().post(
        f"{base}/v1/rerank", json={"model": model, "query": RERANK_QUERY, "documents": documents}
    )
    elapsed = time.perf_counter() - started
    reply.raise_for_status()
    return len(documents) / elapsed, {r["index"]: r["relevance_score"] for r in reply.json()["results"]}


def rerank_figures(
    *, llama_server_binary: str | None, repeats: int = 3, log: Callable[[str], None] = print
) -> list[Figure]:
    if not llama_server_binary:
        log("no llama-server binary (LLAMA_SERVER=$(bash scripts/build_llama_server.sh)): the rerank section needs it")
        return []
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from rerank_model import write_reranker

    documents = [text.removeprefix("search_document: ").lower() for text in short_texts(N_DOCUMENTS)]
    with tempfile.TemporaryDirectory(prefix="localllm-rerank-") as folder:
        path = write_reranker(Path(folder) / "tiny-reranker.gguf")
        # Flash attention off on both: we score without it (its rounding moves scores with the batch), so the
        # two servers compute the same thing.
        with (
            rest.served_model(path, slots=1, threads=None, n_ctx=512) as ours,
            llama_server(llama_server_binary, path, "--rerank", "-fa", "off") as theirs,
        ):
            _rerank_rate(ours, "bench", documents[:8])  # warm-up: the reranking context is made on first use
            _rerank_rate(theirs, "bench", documents[:8])
            scores: dict[str, dict[int, float]] = {}

            def measured(name: str, base: str) -> Callable[[], float]:
                def run() -> float:
                    rate, scores[name] = _rerank_rate(base, "bench", documents)
                    return rate

                return run

            log(f"reranking: {N_DOCUMENTS} documents, llama-server --rerank and localllm serve, {repeats} repeats")
            run = Bracketed.measure(measured("theirs", theirs), measured("ours", ours), repeats=repeats)
    worst = max(abs(scores["ours"][i] - scores["theirs"][i]) for i in range(N_DOCUMENTS))
    figure = run.figure(
        f"{N_DOCUMENTS} documents through /v1/rerank: ours vs llama-server --rerank",
        0.97,
        note=f"one request, a synthetic 2-layer BERT cross-encoder, flash attention off on both; largest score "
        f"difference between the two servers {worst:.2g}",
    )
    figure.unit = "docs/s"
    return [figure]


# ------------------------------------------------------------------------------------------------------- bandwidth


def read_bandwidth(threads: int, *, size: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of reading `size` bytes already in memory with `threads` threads (numpy sums release the GIL), the best
    of `repeats`: what decode, which reads every weight once per token, could reach at most."""
    data = np.ones(size // 8, dtype=np.float64)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=part.sum) for part in parts]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, size / (time.perf_counter() - started) / 1e9)
    return best


def bandwidth_figures(
    path: Path, *, n: int, llama_server_binary: str | None, repeats: int = 3, log: Callable[[str], None] = print
) -> list[Figure]:
    """One stream's decode as a share of the read bandwidth the same threads measure, at 1 thread and at every core,
    ours and llama-server's (both pinned to the count)."""
    from bench_threads import _prompts

    from localllm.machine import physical_cores

    story, _ = _prompts(path)
    figures = []
    for threads in sorted({1, physical_cores()}):
        log(f"bandwidth: reading 1 GiB with {threads} thread(s)")
        gbs = read_bandwidth(threads)
        rates = _decode_rates(path, story, n=n, threads=threads, binary=llama_server_binary, repeats=repeats, log=log)
        figures += [_share(path, who, measured, gbs, threads) for who, measured in rates.items() if measured]
    return figures


def _decode_rates(
    path: Path, story: list[int], *, n: int, threads: int, binary: str | None, repeats: int, log: Callable[[str], None]
) -> dict[str, list[float]]:
    """One stream's decode tok/s at `threads`, `repeats` times each, ours and llama-server's (when given)."""
    from bench_threads import _llama_server_run

    rates: dict[str, list[float]] = {"ours": [], "llama-server": []}
    with rest.served_model(path, slots=1, threads=threads, n_ctx=4096) as ours:
        rest.rest_run(ours, [story], 8)  # warm-up
        for i in range(repeats):
            log(f"bandwidth: localllm serve, one stream at {threads} thread(s), repeat {i + 1}/{repeats}")
            rates["ours"].append(rest.rest_run(ours, [story], n).rate())
    if binary:
        import bench_spec

        server = bench_spec.LlamaServer(binary, path, threads=threads, spec=None, slots=1)
        try:
            server.complete(story[:8], 4)
            for i in range(repeats):
                log(f"bandwidth: llama-server, one stream at {threads} thread(s), repeat {i + 1}/{repeats}")
                rates["llama-server"].append(_llama_server_run(server, [story], n).rate())
        finally:
            server.close()
    return rates


def _share(path: Path, who: str, measured: list[float], gbs: float, threads: int) -> Figure:
    model_bytes = path.stat().st_size
    rate = statistics.median(measured)
    return Figure(
        f"decode as a share of read bandwidth at {threads} thread(s): {who}",
        model_bytes * rate / 1e9,
        gbs,
        "GB/s",
        None,
        note=f"{model_bytes / 1e9:.2f} GB x {rate:.2f} tok/s (median of {len(measured)}) against "
        f"{gbs:.1f} GB/s read by {threads} thread(s); the ratio is the share",
    )
