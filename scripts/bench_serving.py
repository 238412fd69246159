"""Serving under real load, ours at its defaults beside llama-server at its defaults (when its binary is given):

    mixed load     three streams decoding, a long prompt (~1,400 tokens) arrives: the decoders' p99 inter-token gap
                   and the long prompt's time to first token. Without llama-server the references are our own: the
                   long prompt's prefill alone (what one step holding the whole prompt would stall the decoders for)
    memory         the server's RSS with one model loaded and idle, and after the same workload (the mixed load)
    first load     the load of a model this home has never seen (the load probe runs) against a repeated load

    python scripts/bench.py --only mixed memory firstload [--llama-server PATH]
    python scripts/bench_serving.py [--llama-server PATH] [--tokens 96]       # the same, printed only

The client's clock throughout, requests streamed over loopback with raw prompt tokens (/api/generate on ours,
/completion on llama-server), greedy, EOS ignored, so both decode the same work."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from localllm.bench.figures import Figure  # noqa: E402
from localllm.bench.rest import http_client, served_model  # noqa: E402

LONG_TOKENS = 1400
BUSY = "taken on a busy shared machine"  # the note these figures carry until the lead measures them idle
N_CTX = 4096  # our default context per slot, and what llama-server gets per slot from its trained context or more
# A stream function: stream(prompt tokens, n, on_tokens) runs one streamed greedy request to its end.
StreamFn = Callable[[list[int], int, Callable[[list[int]], None]], None]


def _ours(base: str) -> StreamFn:
    def stream(prompt: list[int], n: int, received: Callable[[list[int]], None]) -> None:
        body = {
            "model": "bench",
            "prompt": "",
            "context": prompt,
            "raw": True,
            "stream": True,
            "options": {"temperature": 0, "num_predict": n, "spec_type": "none", "ignore_eos": True},
        }
        with http_client().stream("POST", f"{base}/api/generate", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                chunk = json.loads(line)
                if chunk.get("tokens"):
                    received(chunk["tokens"])

    return stream


def _theirs(server) -> StreamFn:
    def stream(prompt: list[int], n: int, received: Callable[[list[int]], None]) -> None:
        server.stream(prompt, n, received, ignore_eos=True)

    return stream


@dataclass(frozen=True)
class Mixed:
    p99_gap: float  # seconds between a decoder's chunks, after the long prompt arrived
    max_gap: float
    ttft: float  # the long prompt's, on the client's clock


def _prompts(path: Path) -> tuple[list[list[int]], Callable[[int], list[int]]]:
    from localllm.bench.raw import RawLoop

    loop = RawLoop(path, n_ctx=512, threads=1)
    try:
        decoders = [loop.tokenize(f"Story number {i}: once upon a time") for i in range(3)]
        body = loop.tokenize(" the lighthouse keeper read the message again and again," * 160)
    finally:
        loop.close()

    def long(variant: int) -> list[int]:
        # A distinct head for every run, so no server finds the prompt in a cache.
        return [body[0], *[(t + variant * 7919) % 30000 + 100 for t in body[1:9]], *body[9:LONG_TOKENS]]

    return decoders, long


def mixed_run(stream: StreamFn, decoders: list[list[int]], long: list[int], n: int) -> Mixed:
    arrivals: list[list[float]] = [[] for _ in decoders]
    going = [threading.Event() for _ in decoders]

    def decode(i: int) -> None:
        def received(tokens: list[int]) -> None:
            arrivals[i].append(time.perf_counter())
            if len(arrivals[i]) >= 4:
                going[i].set()

        stream(decoders[i], n, received)
        going[i].set()

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(decoders))]
    for t in threads:
        t.start()
    for event in going:
        event.wait(600)
    first: list[float] = []
    sent = time.perf_counter()
    stream(long, 1, lambda tokens: first.append(time.perf_counter()) if not first else None)
    for t in threads:
        t.join()
    gaps = sorted(b - a for times in arrivals for a, b in zip(times, times[1:]) if b > sent)
    if not gaps or not first:
        raise RuntimeError("the decoders ended before the long prompt arrived: raise --tokens")
    return Mixed(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], gaps[-1], first[0] - sent)


def alone_ttft(stream: StreamFn, long: list[int]) -> float:
    first: list[float] = []
    sent = time.perf_counter()
    stream(long, 1, lambda tokens: first.append(time.perf_counter()) if not first else None)
    return first[0] - sent


def rss(pid: int) -> float:
    """Resident memory of process `pid`, MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def llama_server(binary: str, path: Path) -> Iterator:
    import bench_spec

    from localllm.machine import physical_cores

    server = bench_spec.LlamaServer(binary, path, threads=physical_cores(), spec=None, defaults=True)
    try:
        server.complete([1, 2, 3], 2)  # warm up
        yield server
    finally:
        server.close()


def mixed_and_memory_figures(
    path: Path, *, n: int = 256, llama_server_binary: str | None = None, log: Callable[[str], None] = print
) -> tuple[list[Figure], list[Figure]]:
    """The mixed load on ours (and llama-server's), and the servers' RSS idle and after it."""
    from localllm.bench import rest

    decoders, long = _prompts(path)
    with served_model(path, slots=4, threads=None, n_ctx=N_CTX) as base:
        pid = rest.SERVED_PIDS[base]
        ours = _ours(base)
        idle = rss(pid)
        log("serving: our lone long prompt")
        alone = alone_ttft(ours, long(1))
        log("serving: our mixed load")
        mixed = mixed_run(ours, decoders, long(2), n)
        busy = rss(pid)
    theirs: Mixed | None = None
    their_idle = their_busy = float("nan")
    if llama_server_binary:
        with llama_server(llama_server_binary, path) as server:
            their_idle = rss(server.proc.pid)
            log("serving: llama-server's mixed load")
            theirs = mixed_run(_theirs(server), decoders, long(3), n)
            their_busy = rss(server.proc.pid)
    shared = BUSY
    mixed_figures = [
        Figure(
            "mixed: long prompt TTFT beside 3 decoders vs alone",
            mixed.ttft,
            alone,
            "s",
            1.1,
            lower_is_better=True,
            note=f"{LONG_TOKENS} tokens; ours at its defaults; {shared}",
        )
    ]
    if theirs is None:
        mixed_figures.append(
            Figure(
                "mixed: decoders' p99 gap vs the prompt's prefill alone",
                mixed.p99_gap,
                alone,
                "s",
                0.5,
                lower_is_better=True,
                note=f"max gap {mixed.max_gap:.2f} s; the reference is one step holding the whole prompt; {shared}",
            )
        )
    else:
        mixed_figures += [
            Figure(
                "mixed: decoders' p99 gap, ours vs llama-server",
                mixed.p99_gap,
                theirs.p99_gap,
                "s",
                0.5,
                lower_is_better=True,
                note=f"max gap {mixed.max_gap:.2f} s vs {theirs.max_gap:.2f} s; both at defaults; {shared}",
            ),
            Figure(
                "mixed: long prompt TTFT, ours vs llama-server",
                mixed.ttft,
                theirs.ttft,
                "s",
                1.1,
                lower_is_better=True,
                note=f"{LONG_TOKENS} tokens beside 3 decoders; {shared}",
            ),
        ]
    memory = [
        Figure(
            "memory: server RSS after the mixed load" + (", ours vs llama-server" if theirs else ""),
            busy,
            their_busy if theirs else idle,
            "MiB",
            1.2 if theirs else None,
            lower_is_better=True,
            note=("both at defaults" if theirs else "reference: ours idle with the model loaded") + f"; {shared}",
        ),
        Figure(
            "memory: idle RSS, one model loaded" + (", ours vs llama-server" if theirs else ""),
            idle,
            their_idle if theirs else idle,
            "MiB",
            None,
            lower_is_better=True,
            note=shared,
        ),
    ]
    return mixed_figures, memory


def first_load_figures(path: Path, *, log: Callable[[str], None] = print) -> list[Figure]:
    """The first load of weights this home has never probed against a repeated load of them, in one warm server:
    its probe memory is removed between its start-up load and the timed first load, so the server's own start-up
    (imports, the backend's set-up) is in neither figure."""
    import shutil
    import tempfile

    client = http_client()
    with tempfile.TemporaryDirectory(prefix="localllm-bench-") as home:
        probes = Path(home) / "models" / "probes"
        with served_model(path, slots=4, threads=None, n_ctx=N_CTX, home=Path(home)) as base:

            def load() -> float:
                client.post(f"{base}/api/generate", json={"model": "bench", "keep_alive": 0}, timeout=300)  # unload
                _wait_for_trials(probes)  # the flash trial runs in the background: not beside a timed load
                started = time.perf_counter()
                client.post(f"{base}/api/generate", json={"model": "bench", "prompt": ""}, timeout=300)
                return time.perf_counter() - started

            _wait_for_trials(probes)
            shutil.rmtree(probes, ignore_errors=True)
            log("serving: the first load of a never-probed model")
            first = load()
            log("serving: a repeated load")
            again = min(load(), load())
    return [
        Figure(
            "first load of a never-seen model vs a repeated load",
            first,
            again,
            "s",
            1.3,
            lower_is_better=True,
            note="the load probe runs (its flash trial after, in the background); the repeated load the best of two; "
            + BUSY,
        )
    ]


def _wait_for_trials(probes: Path, timeout: float = 300) -> None:
    """Until every probe memory under `probes` says its flash trial has run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = []
        for entry in probes.glob("*") if probes.is_dir() else []:
            try:
                pending.append(not json.loads(entry.read_text()).get("trial_done", True))
            except (OSError, ValueError):
                pending.append(True)
        if not any(pending):
            return
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each decoder streams in the mixed load")
    parser.add_argument("--llama-server", default=None)
    args = parser.parse_args()
    from localllm.models.store import Store

    path = Store().resolve(args.model).weights
    mixed, memory = mixed_and_memory_figures(path, n=args.tokens, llama_server_binary=args.llama_server)
    for f in [*mixed, *memory, *first_load_figures(path)]:
        print(f"  {f.name:58} ours {f.ours:9.2f} ref {f.reference:9.2f} {f.unit:4} ratio {f.ratio:5.2f}  {f.note}")


if __name__ == "__main__":
    main()
