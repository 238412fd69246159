"""Serving under real load, ours at its defaults beside llama-server at its defaults (when its binary is given):

    mixed load     three streams decoding, a long prompt (~1,400 tokens) arrives: the decoders' p99 inter-token gap
                   while it prefills and the long prompt's time to first token. Without llama-server the references
                   are our own: the long prompt's prefill alone (what one step holding the whole prompt would stall
                   the decoders for)
    memory         the server's RSS with one model loaded and idle, and after the same workload (the mixed load)
    first load     the load of a model this home has never seen (the load probe runs) against a repeated load

    python scripts/bench.py --only mixed memory firstload [--llama-server PATH]
    python scripts/bench_serving.py [--llama-server PATH] [--tokens 96]       # the same, printed only

The client's clock throughout, requests streamed over loopback with raw prompt tokens (/api/generate on ours,
/completion on llama-server), greedy, EOS ignored, so both decode the same work."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from localllm.bench.figures import Figure  # noqa: E402
from localllm.bench.rest import free_port, http_client, served_model, wait_for_trials  # noqa: E402

LONG_TOKENS = 1400
ROUNDS = 3
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
    p99_gap: float  # seconds between a decoder's chunks, of the gaps that overlap the long prompt's prefill
    max_gap: float
    ttft: float  # the long prompt's, on the client's clock
    p99_after: float  # of every gap after the long prompt arrived (diluted by the steady decode after it)


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
    pairs = [(a, b) for times in arrivals for a, b in zip(times, times[1:]) if b > sent]
    # What a decoder feels while the prompt prefills: the gaps that overlap it (one stall of the whole prefill, or
    # many short ones); the gaps after it only dilute a percentile with steady decoding.
    during = sorted(b - a for a, b in pairs if first and a < first[0])
    if not during:
        raise RuntimeError("the decoders ended before the long prompt arrived: raise --tokens")
    after = sorted(b - a for a, b in pairs)
    return Mixed(_p99(during), during[-1], first[0] - sent, _p99(after))


def _p99(values: list[float]) -> float:
    return values[min(len(values) - 1, int(0.99 * len(values)))]


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


@dataclass
class Served:
    """A server under test: how to stream to it, its process, and what each round measured."""

    stream: StreamFn
    pid: int
    alone: list[float] = field(default_factory=list)  # the long prompt's TTFT with nothing else running
    mixed: list[Mixed] = field(default_factory=list)
    idle_rss: float = 0.0
    busy_rss: float = 0.0


def mixed_and_memory_figures(
    path: Path,
    *,
    n: int = 256,
    rounds: int = ROUNDS,
    llama_server_binary: str | None = None,
    log: Callable[[str], None] = print,
) -> tuple[list[Figure], list[Figure]]:
    """The same workload on ours and llama-server (when given), both at their defaults, in interleaved rounds: a
    lone long prompt, then three decoders with a long prompt arriving; each server's RSS idle and after all rounds."""
    from localllm.bench import rest

    decoders, long = _prompts(path)
    with ExitStack() as stack:
        base = stack.enter_context(served_model(path, slots=4, threads=None, n_ctx=N_CTX))
        servers = {"ours": Served(_ours(base), rest.SERVED_PIDS[base])}
        if llama_server_binary:
            server = stack.enter_context(llama_server(llama_server_binary, path))
            servers["llama-server"] = Served(_theirs(server), server.proc.pid)
        for served in servers.values():
            served.idle_rss = rss(served.pid)
        for r in range(rounds):
            for k, (who, served) in enumerate(servers.items()):
                variant = 2 * (r * len(servers) + k)  # a long prompt no server has seen
                log(f"serving: {who}, round {r + 1}/{rounds}: the long prompt alone, then beside 3 decoders")
                served.alone.append(alone_ttft(served.stream, long(variant)))
                served.mixed.append(mixed_run(served.stream, decoders, long(variant + 1), n))
        for served in servers.values():
            served.busy_rss = rss(served.pid)
    return _mixed_figures(servers, rounds), _memory_figures(servers)


def _median(values) -> float:
    return statistics.median(list(values))


def _mixed_figures(servers: dict[str, Served], rounds: int) -> list[Figure]:
    ours, theirs = servers["ours"], servers.get("llama-server")
    of = f"median of {rounds} interleaved rounds"
    gap, ttft = _median(m.p99_gap for m in ours.mixed), _median(m.ttft for m in ours.mixed)
    figures = [
        Figure(
            "mixed: long prompt TTFT beside 3 decoders vs alone (ours)",
            ttft,
            _median(ours.alone),
            "s",
            None,
            lower_is_better=True,
            note=f"{LONG_TOKENS} tokens; {of}",
        )
    ]
    if theirs is None:
        return figures + [
            Figure(
                "mixed: decoders' p99 gap during the prefill vs the prefill alone",
                gap,
                _median(ours.alone),
                "s",
                0.5,
                lower_is_better=True,
                note=f"max gap {max(m.max_gap for m in ours.mixed):.2f} s; the reference is one step holding the "
                f"whole prompt; {of}",
            )
        ]
    their_gap, their_ttft = _median(m.p99_gap for m in theirs.mixed), _median(m.ttft for m in theirs.mixed)
    max_gaps = f"{max(m.max_gap for m in ours.mixed):.2f} s vs {max(m.max_gap for m in theirs.mixed):.2f} s"
    after = f"{_median(m.p99_after for m in ours.mixed):.2f} s vs {_median(m.p99_after for m in theirs.mixed):.2f} s"
    return figures + [
        Figure(
            "mixed: decoders' p99 gap, ours vs llama-server",
            gap,
            their_gap,
            "s",
            0.5,
            lower_is_better=True,
            note=f"gaps overlapping the long prompt's prefill; largest {max_gaps}; p99 of every gap after it "
            f"arrived {after}; both at their defaults; {of}",
        ),
        Figure(
            "mixed: long prompt TTFT, ours vs llama-server",
            ttft,
            their_ttft,
            "s",
            1.1,
            lower_is_better=True,
            note=f"{LONG_TOKENS} tokens beside 3 decoders; alone {_median(ours.alone):.2f} s vs "
            f"{_median(theirs.alone):.2f} s; {of}",
        ),
    ]


def _memory_figures(servers: dict[str, Served]) -> list[Figure]:
    ours, theirs = servers["ours"], servers.get("llama-server")
    if theirs is None:
        return [
            Figure(
                "memory: server RSS after the mixed load vs idle (ours)",
                ours.busy_rss,
                ours.idle_rss,
                "MiB",
                None,
                lower_is_better=True,
                note="one model loaded at the defaults",
            )
        ]
    return [
        Figure(
            "memory: server RSS after the same workload, ours vs llama-server",
            ours.busy_rss,
            theirs.busy_rss,
            "MiB",
            1.2,
            lower_is_better=True,
            note="both at their defaults, after every round of the mixed load",
        ),
        Figure(
            "memory: idle RSS with one model loaded, ours vs llama-server",
            ours.idle_rss,
            theirs.idle_rss,
            "MiB",
            None,
            lower_is_better=True,
            note="both at their defaults, the model loaded and one request answered",
        ),
    ]


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
                wait_for_trials(Path(home))  # the flash trial runs in the background: not beside a timed load
                started = time.perf_counter()
                client.post(f"{base}/api/generate", json={"model": "bench", "prompt": ""}, timeout=300)
                return time.perf_counter() - started

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
            note="the load check runs (a catalog file: no child; the flash trial after the load, in the background); "
            "the repeated load the best of two",
        )
    ]


def first_run_figures(path: Path, *, log: Callable[[str], None] = print) -> list[Figure]:
    """What a newcomer meets: `localllm run MODEL PROMPT` right after the model is stored in a fresh home (no server
    running, the model never probed), against the same command once its probe is remembered. Each run starts the
    background server `run` uses and stops it after; greedy, 16 tokens."""
    import tempfile

    from localllm.bench.rest import create_bench_model

    with tempfile.TemporaryDirectory(prefix="localllm-bench-") as home:
        create_bench_model(path, Path(home), parameters={"temperature": 0, "num_predict": 16})
        log("serving: the first `localllm run` after a pull")
        first = _timed_run(Path(home))
        log("serving: `localllm run` again, the probe remembered")
        again = min(_timed_run(Path(home)), _timed_run(Path(home)))
    return [
        Figure(
            "first `localllm run` after a pull vs a later run",
            first,
            again,
            "s",
            None,
            lower_is_better=True,
            note="one-shot, each starting the background server; the later run the best of two",
        )
    ]


def _timed_run(home: Path) -> float:
    """Seconds of `localllm run bench PROMPT` in `home` on a free port, its background server stopped after."""
    import os
    import subprocess

    env = {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_HOST": f"127.0.0.1:{free_port()}"}
    command = [sys.executable, "-m", "localllm"]
    started = time.perf_counter()
    done = subprocess.run([*command, "run", "bench", "Say hello."], env=env, capture_output=True, timeout=600)
    seconds = time.perf_counter() - started
    subprocess.run([*command, "serve", "--stop"], env=env, capture_output=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"localllm run failed: {done.stderr.decode()[-500:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each decoder streams in the mixed load")
    parser.add_argument("--llama-server", default=None)
    args = parser.parse_args()
    from localllm.models.store import Store

    path = Store().resolve(args.model).weights
    mixed, memory = mixed_and_memory_figures(path, n=args.tokens, llama_server_binary=args.llama_server)
    for f in [*mixed, *memory, *first_load_figures(path), *first_run_figures(path)]:
        print(f"  {f.name:58} ours {f.ours:9.2f} ref {f.reference:9.2f} {f.unit:4} ratio {f.ratio:5.2f}  {f.note}")


if __name__ == "__main__":
    main()
