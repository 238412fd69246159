"""The defaults section of scripts/bench.py: what a user gets without setting anything.

Ours at its defaults (threads tuned as the model runs, LOCALLLM_NUM_THREAD unset) against:
  - llama.cpp's own llama-server at its defaults (`llama-server -m MODEL`), idle: one stream and four, decode tok/s
    and time to first token, both through their servers on the client's clock;
  - the best raw llama.cpp loop over 1..physical cores threads, idle and with one core kept busy elsewhere (the raw
    loop is measured at every count under the same load; its best is the reference);
and how many decode steps the tuner took to settle again after the load changed."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from localllm.bench import rest
from localllm.bench.engine import (
    FOUR_PROMPTS,
    LONG_STORY,
    EngineRun,
    busy_core,
    concurrent_streams,
    engine_run,
    make_engine,
)
from localllm.bench.figures import Figure
from localllm.bench.raw import RawLoop, raw_decode_rate
from localllm.chat.templates import render_chat
from localllm.machine import physical_cores

N_CTX = 4096


def thread_figures(
    path: Path, *, n: int, llama_server: str | None, repeats: int = 3, log: Callable[[str], None] = print
) -> list[Figure]:
    os.environ.pop("LOCALLLM_NUM_THREAD", None)  # defaults: nothing pinned
    story, four = _prompts(path)
    cores = physical_cores()
    figures = _raw_against_defaults(path, story, n=n, cores=cores, repeats=repeats, log=log)
    if llama_server:
        figures += _servers_at_defaults(path, llama_server, story, four, n=n, repeats=repeats, log=log)
    else:
        log("no llama-server binary (LLAMA_SERVER=$(bash scripts/build_llama_server.sh)): its rows are skipped")
    return figures


def _prompts(path: Path) -> tuple[list[int], list[list[int]]]:
    loop = RawLoop(path, n_ctx=512, threads=1)
    try:
        import llama_cpp

        raw = llama_cpp.llama_model_chat_template(loop.model, None)
        template = raw.decode() if raw else None

        def render(text: str) -> list[int]:
            return loop.tokenize(render_chat(template, [{"role": "user", "content": text}]))

        return render(LONG_STORY), [render(p) for p in FOUR_PROMPTS]
    finally:
        loop.close()


def _best_raw(path: Path, story: list[int], *, n: int, cores: int) -> tuple[int, float]:
    rates = {t: raw_decode_rate(path, story, n, threads=t, n_ctx=N_CTX)[0] for t in range(1, cores + 1)}
    best = max(rates, key=rates.__getitem__)
    return best, rates[best]


def _raw_against_defaults(
    path: Path, story: list[int], *, n: int, cores: int, repeats: int, log: Callable[[str], None]
) -> list[Figure]:
    engine = make_engine(path, threads=None, n_ctx=N_CTX)
    tuner = engine.threads
    assert tuner is not None
    try:
        figures = []
        for label, load, target in (("idle", _idle, 0.97), ("one core busy", busy_core, 0.9)):
            best_t, best, ours = 0, 0.0, 0.0
            with load():
                for i in range(repeats):
                    log(f"defaults, {label}: raw loop at 1..{cores} threads and ours, repeat {i + 1}/{repeats}")
                    t, rate = _best_raw(path, story, n=n, cores=cores)
                    if rate > best:
                        best_t, best = t, rate
                    ours = max(ours, engine_run(engine, [story], n).rate())
                settled = tuner.settled("decode")
                steps = tuner.trial_steps("decode")
            figures.append(
                Figure(
                    f"defaults, {label}: single stream vs the best raw thread count",
                    ours,
                    best,
                    "tok/s",
                    target,
                    note=f"raw best at {best_t} of 1..{cores} thread(s); ours settled on {settled} "
                    f"thread(s), its last trial took {steps} decode steps",
                )
            )
        return figures
    finally:
        engine.close()


@contextmanager
def _idle() -> Iterator[None]:
    yield


def _servers_at_defaults(
    path: Path,
    binary: str,
    story: list[int],
    four: list[list[int]],
    *,
    n: int,
    repeats: int,
    log: Callable[[str], None],
) -> list[Figure]:
    import bench_spec

    server = bench_spec.LlamaServer(binary, path, threads=0, spec=None, defaults=True)
    try:
        with rest.served_model(path, slots=4, threads=None, n_ctx=N_CTX) as base:
            rest.rest_run(base, four, 8)  # warm-up, as for llama-server below
            server.complete(four[0][:8], 4)
            rows: dict[str, tuple[list[float], list[float]]] = {}
            for i in range(repeats):
                for name, prompts in (("single stream", [story]), ("4 streams", four)):
                    log(f"defaults vs llama-server's: {name}, repeat {i + 1}/{repeats}")
                    theirs = _llama_server_run(server, prompts, n)
                    ours = rest.rest_run(base, prompts, n)
                    rates, firsts = rows.setdefault(name, ([], []))
                    rates.append(ours.rate() / theirs.rate())
                    firsts.append(ours.ttft() / theirs.ttft())
                    rows[name + " raw"] = rows.get(name + " raw", ([], []))
                    rows[name + " raw"][0].append(theirs.rate())
                    rows[name + " raw"][1].append(theirs.ttft())
    finally:
        server.close()
    figures = []
    for name in ("single stream", "4 streams"):
        rates, firsts = rows[name]
        their_rate = statistics.median(rows[name + " raw"][0])
        their_ttft = statistics.median(rows[name + " raw"][1]) * 1000
        rate = statistics.median(rates)
        first = statistics.median(firsts)
        note = f"median of {repeats} interleaved runs, both servers at their defaults, the client's clock"
        figures.append(
            Figure(
                f"defaults vs llama-server's: {name} decode", rate * their_rate, their_rate, "tok/s", 0.97, note=note
            )
        )
        # 0.97x of its speed in time to first token is at most 1/0.97 of its time.
        figures.append(
            Figure(
                f"defaults vs llama-server's: {name} time to first token",
                first * their_ttft,
                their_ttft,
                "ms",
                round(1 / 0.97, 3),
                lower_is_better=True,
                note=note,
            )
        )
    return figures


def _llama_server_run(server, prompts: list[list[int]], n: int) -> EngineRun:
    def one(i: int, run: EngineRun) -> None:
        server.stream(prompts[i], n, lambda tokens: run.received(i, tokens), ignore_eos=True)

    return concurrent_streams(EngineRun.start(len(prompts)), one)
