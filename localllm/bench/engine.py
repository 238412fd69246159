"""Our engine against the raw loop: single stream, prefill, a second chat turn, one core busy, four streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..api import LoadOptions, SamplingOptions
from ..backends.llama_cpp.backend import LlamaCppBackend
from ..engine.runner import GenerationParams, ModelEngine
from ..engine.threads import ThreadTuner
from ..machine import physical_cores
from .figures import BRACKET_REPEATS, Bracketed, Figure
from .raw import raw_batched_rate, raw_decode_rate, raw_prefill_rate

LONG_STORY = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
FOUR_PROMPTS = (
    "Write a long story about a dragon.",
    "Explain how a steam engine works, in detail.",
    "List one hundred animals and describe each one.",
    "Write a long poem about the sea.",
)


def _shared_prefix_text(target_tokens: int, tokenize: Callable[[str], list[int]]) -> str:
    """A system prompt of about `target_tokens` tokens (a product manual), as a long shared chat prefix."""
    paragraph = (
        "Section {i}. The device must be cleaned weekly with a dry cloth. Do not immerse it in water. "
        "If the status light blinks red, hold the reset button for ten seconds and wait for green. "
    )
    text, i = "", 0
    while len(tokenize(text)) < target_tokens:
        text += paragraph.format(i=i)
        i += 1
    return text


@contextmanager
def busy_core() -> Iterator[None]:
    """Keep one core busy with a spinning process (the 'other work' of the contention figure)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        yield
    finally:
        proc.kill()
        proc.wait()


@dataclass
class EngineRun:
    """What the streams of one run received: tokens, and when each chunk of them arrived."""

    tokens: list[list[int]] = field(default_factory=list)
    arrivals: list[list[tuple[float, int]]] = field(default_factory=list)  # per stream: (time, tokens in the chunk)
    submitted: float = 0.0

    @classmethod
    def start(cls, streams: int) -> EngineRun:
        return cls(
            tokens=[[] for _ in range(streams)], arrivals=[[] for _ in range(streams)], submitted=time.perf_counter()
        )

    def received(self, stream: int, tokens: Sequence[int]) -> None:
        self.arrivals[stream].append((time.perf_counter(), len(tokens)))
        self.tokens[stream].extend(tokens)

    def rate(self) -> float:
        """Decode tokens per second once every stream has its first token, the raw loop's window (its clock starts
        after all prompts are prefilled): the tokens that arrive after that, over the time to the last one."""
        start = max(chunks[0][0] for chunks in self.arrivals)
        end = max(chunks[-1][0] for chunks in self.arrivals)
        tokens = sum(n for chunks in self.arrivals for t, n in chunks if t > start)
        return tokens / (end - start) if end > start else 0.0

    def ttft(self) -> float:
        return min(chunks[0][0] for chunks in self.arrivals) - self.submitted

    def throughput(self) -> float:
        """Every token over the time from submission to the last one: with more streams than slots the later ones
        wait for a slot, and that waiting is part of what the clients get."""
        end = max(chunks[-1][0] for chunks in self.arrivals)
        tokens = sum(n for chunks in self.arrivals for _, n in chunks)
        return tokens / (end - self.submitted) if end > self.submitted else 0.0


def make_engine(path: Path, *, threads: int | None, n_ctx: int, n_slots: int = 1) -> ModelEngine:
    """Our engine on `path`; `threads` pins the count, None tunes it as it runs (the server's default)."""
    opts = LoadOptions(num_thread=threads, num_ctx=n_ctx, num_parallel=n_slots)
    model = LlamaCppBackend().load(path, opts)
    tuner = ThreadTuner(physical_cores()) if threads is None else None
    return ModelEngine(model, max_queue=16, threads=tuner, pinned_threads=threads or 0)


def user_turn_tokens(engine: ModelEngine, content: str) -> list[int]:
    """`content` as one user message in the model's chat template, tokenized with the template's BOS (not twice)."""
    from ..chat.templates import render_chat

    meta = engine.meta
    bos = engine.token_text(meta.bos_token) if meta.bos_token is not None else ""
    text = render_chat(meta.chat_template, [{"role": "user", "content": content}], bos_token=bos)
    return engine.tokenize(text, add_special=not (bos and text.startswith(bos)))


def engine_run(engine: ModelEngine, prompts: list[list[int]], n: int, **sampling) -> EngineRun:
    # Every stream runs exactly n tokens (EOS banned, in the raw loop too), so both sides decode the same work.
    opts = SamplingOptions(**{"temperature": 0, "num_predict": n, "spec_type": "none", "ignore_eos": True, **sampling})
    run = EngineRun.start(len(prompts))
    streams = engine.submit_all([GenerationParams(list(p), opts) for p in prompts])
    return concurrent_streams(run, lambda i, into: _drain(streams[i], into, i))


def _drain(stream, run: EngineRun, i: int) -> None:
    for chunk in stream:
        if chunk.tokens:
            run.received(i, chunk.tokens)


def run_benchmarks(
    path: Path,
    *,
    n: int = 128,
    n_ctx: int = 4096,
    threads: int | None = None,
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> list[Figure]:
    """Every figure of the engine benchmark for one GGUF model. `threads`: our engine's (default: LOCALLLM_NUM_THREAD,
    else the physical cores), pinned; the raw reference runs at the same count, and once at the other count of a
    2-core machine, for an informational row. Speeds are the best of `repeats` runs, ours and the reference
    interleaved, so a burst of load from elsewhere on the machine hits both sides alike; four streams, which do the
    raw loop's work, are Bracketed."""
    from .. import config
    from ..chat.templates import render_chat

    # Same-work figures pin our engine to the raw loop's count (the tuner's own figures are scripts/bench_threads.py).
    ours_threads = threads or config.NUM_THREAD.get() or physical_cores()
    engine = make_engine(path, threads=ours_threads, n_ctx=n_ctx)
    template = engine.model.meta.chat_template

    def chat_tokens(messages: list[dict]) -> list[int]:
        return engine.tokenize(render_chat(template, messages))

    story = chat_tokens([{"role": "user", "content": LONG_STORY}])
    four = [chat_tokens([{"role": "user", "content": p}]) for p in FOUR_PROMPTS]
    try:
        log(f"single stream: raw at {ours_threads} and {_other_threads(ours_threads)} threads, and ours, interleaved")
        single, other = _single_stream(engine, path, story, n=n, n_ctx=n_ctx, threads=ours_threads, repeats=repeats)
        log("prefill, and a second chat turn over the shared prefix")
        prefill, second_turn = _prefill_and_second_turn(
            engine, path, chat_tokens, threads=ours_threads, n_ctx=n_ctx, repeats=repeats
        )
        log("one core busy")
        idle = engine_run(engine, [story], n).rate()
        with busy_core():
            busy = engine_run(engine, [story], n).rate()
        contention = Figure(
            "decode with one core busy",
            busy,
            idle,
            "tok/s",
            0.4,
            note=f"ours with {ours_threads} thread(s); reference is ours idle",
        )
    finally:
        engine.close()
    log("4 concurrent streams")
    four_streams = _four_streams(
        path, four, n=n, n_ctx=n_ctx, threads=ours_threads, repeats=max(repeats, BRACKET_REPEATS)
    )
    return [single, four_streams, prefill, second_turn, contention, other]


def _other_threads(threads: int) -> int:
    """The thread count the informational row compares with: all cores when ours leaves one free, else one."""
    import os

    cores = os.cpu_count() or 1
    return cores if threads < cores else max(1, threads - 1)


def _single_stream(
    engine: ModelEngine, path: Path, story: list[int], *, n: int, n_ctx: int, threads: int, repeats: int
) -> tuple[Figure, Figure]:
    other_t = _other_threads(threads)
    raw = {threads: 0.0, other_t: 0.0}
    ours = 0.0
    for _ in range(repeats):
        for t in raw:
            raw[t] = max(raw[t], raw_decode_rate(path, story, n, threads=t, n_ctx=n_ctx)[0])
        ours = max(ours, engine_run(engine, [story], n).rate())
    same = Figure(
        "single stream decode", ours, raw[threads], "tok/s", 0.97, note=f"raw loop at the same {threads} thread(s)"
    )
    other = Figure(
        f"single stream decode: ours ({threads} thread(s), the default) vs raw at {other_t} thread(s)",
        ours,
        raw[other_t],
        "tok/s",
        None,
        note="informational: what the thread default gives up on an idle machine (see the notes)",
    )
    return same, other


def _prefill_and_second_turn(
    engine: ModelEngine, path: Path, chat_tokens, *, threads: int, n_ctx: int, repeats: int
) -> tuple[Figure, Figure]:
    raw_rate, ours_rate, first_ms, second_ms, size = 0.0, 0.0, 0.0, 0.0, 0
    for r in range(repeats):
        # A different first word each time, so no run reuses the previous one's cache.
        prefix = f"Manual edition {r}. " + _shared_prefix_text(1500, engine.tokenize)
        first = [{"role": "system", "content": prefix}, {"role": "user", "content": "Summarise."}]
        prompt = chat_tokens(first)
        size = len(prompt)
        raw_rate = max(raw_rate, raw_prefill_rate(path, prompt, threads=threads, n_ctx=n_ctx))
        turn1 = engine_run(engine, [prompt], 16)
        ours_rate = max(ours_rate, len(prompt) / turn1.ttft())
        reply = b"".join(engine.model.token_bytes(t) for t in turn1.tokens[0]).decode("utf-8", "replace")
        second = chat_tokens(first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}])
        turn2 = engine_run(engine, [second], 16)
        first_ms, second_ms = turn1.ttft() * 1000, turn2.ttft() * 1000
    prefill = Figure(
        "prefill",
        ours_rate,
        raw_rate,
        "tok/s",
        0.97,
        note=f"{size}-token prompt, raw at the same {threads} thread(s); ours is prompt size / time to first token",
    )
    second_turn = Figure(
        "second-turn time to first token",
        second_ms,
        first_ms,
        "ms",
        0.1,
        lower_is_better=True,
        note=f"{size}-token shared prefix; reference is our first turn",
    )
    return prefill, second_turn


def _four_streams(path: Path, prompts: list[list[int]], *, n: int, n_ctx: int, threads: int, repeats: int) -> Figure:
    engine = make_engine(path, threads=threads, n_ctx=n_ctx, n_slots=4)
    try:
        bracket = Bracketed.measure(
            lambda: raw_batched_rate(path, prompts, n, threads=threads, n_ctx=n_ctx),
            lambda: engine_run(engine, prompts, n).rate(),
            repeats=repeats,
        )
    finally:
        engine.close()
    return bracket.figure(
        "4 concurrent streams (aggregate)", 1.0, note=f"raw batched loop at the same {threads} thread(s)"
    )


def concurrent_streams(run: EngineRun, one: Callable[[int, EngineRun], None]) -> EngineRun:
    """Run `one(i, run)` for every stream of `run` at once, each in its own client thread; `run` has what they
    received."""
    threads = [threading.Thread(target=one, args=(i, run)) for i in range(len(run.tokens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return run
