"""The prompts section of scripts/bench.py: long prompts at the defaults, ours against llama-server's.

Prompts of SIZES tokens, each request's text its own (numbered lines of code-like text from a seed no other request
uses, the seed first), so no prefix cache on either side can help. Each goes as one streamed /v1/chat/completions
request to `localllm serve` and to `llama-server -m MODEL`, both at their defaults (no context, slot or thread
setting), one request at a time, the two servers taking turns first. Per size: time to first token and the decode
rate after it (DECODE_TOKENS tokens, greedy, EOS ignored), medians of the repeats, and the cost curve, seconds per
1K prompt tokens at each size, in the notes.

    python scripts/bench.py --models qwen2.5-coder:0.5b --only prompts --llama-server PATH
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from localllm.bench import rest
from localllm.bench.figures import Figure
from localllm.bench.raw import RawLoop
from localllm.chat.templates import render_chat

SIZES = (1024, 4096, 8192, 16384)  # prompt tokens, the 1K, 4K, 8K and 16K
REPEATS = 3
DECODE_TOKENS = 64
TTFT_TARGET = 1.05  # ours / llama-server's, at most
DECODE_TARGET = 0.95  # ours / llama-server's, at least
# Settings a user has not made at the defaults: the environment this script runs in must not set them for our server.
PINNED = ("LOCALLLM_NUM_THREAD", "LOCALLLM_CONTEXT_LENGTH", "LOCALLLM_NUM_PARALLEL")

VERBS = ("parse", "load", "merge", "render", "score", "flush", "index", "route", "split", "encode", "fetch", "sort")
NOUNS = ("header", "token", "buffer", "record", "packet", "layer", "query", "cursor", "frame", "block", "batch", "node")
TYPES = ("int", "str", "bytes", "bool", "float", "list[int]", "dict[str, float]", "tuple[int, str]")
OPS = ("+", "-", "*", "//", "%", "<<", "^", "|")


@dataclass
class PromptRun:
    """One streamed request on the client's clock: when it was sent, when each chunk with text arrived, and the
    token counts the server reported."""

    submitted: float
    arrivals: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def ttft(self) -> float:
        return self.arrivals[0] - self.submitted

    def decode_rate(self) -> float:
        """Tokens after the first over the time from the first to the last; a chunk counts as one token where the
        server did not report its count."""
        tokens = self.completion_tokens or len(self.arrivals)
        span = self.arrivals[-1] - self.arrivals[0]
        return (tokens - 1) / span if span > 0 else 0.0

    def seconds_per_1k(self) -> float:
        return self.ttft() / (self.prompt_tokens / 1000) if self.prompt_tokens else float("nan")


@dataclass
class SizeRuns:
    """Every repeat's run at one prompt size, per server."""

    ours: list[PromptRun] = field(default_factory=list)
    theirs: list[PromptRun] = field(default_factory=list)


def prompt_figures(
    path: Path,
    *,
    llama_server: str | None,
    sizes: Sequence[int] = SIZES,
    repeats: int = REPEATS,
    log: Callable[[str], None] = print,
) -> list[Figure]:
    if not llama_server:
        log("no llama-server binary (LLAMA_SERVER=$(bash scripts/build_llama_server.sh)): the prompts section needs it")
        return []
    if repeats < 1 or any(size < 64 for size in sizes):
        raise ValueError(f"prompts section: repeats {repeats} and sizes {list(sizes)} must be >= 1 and >= 64 tokens")
    for name in PINNED:
        os.environ.pop(name, None)  # defaults: nothing set, for the server served_model starts below
    texts, trained = _texts(path, sizes, repeats, log)
    runs = {size: SizeRuns() for size in texts}
    import bench_spec

    server = bench_spec.LlamaServer(llama_server, path, threads=0, spec=None, defaults=True)
    try:
        with rest.served_model(path, slots=None, threads=None, n_ctx=None) as ours:
            theirs = f"http://127.0.0.1:{server.port}"
            for base in (ours, theirs):  # the first requests after a load pay for warm-up
                chat_run(base, "Say hello.", 4)
            for r in range(repeats):
                for size, prompts in texts.items():
                    turns = [("ours", ours), ("llama-server", theirs)]
                    for name, base in turns if r % 2 else turns[::-1]:
                        log(f"prompts: {size} tokens, {name}, repeat {r + 1}/{repeats}")
                        run = chat_run(base, prompts[r], DECODE_TOKENS)
                        (runs[size].ours if base == ours else runs[size].theirs).append(run)
    finally:
        server.close()
    log(f"prompts: cost curve, s per 1K prompt tokens: {_curve(runs)}")
    return _figures(runs, trained)


def _texts(path: Path, sizes: Sequence[int], repeats: int, log) -> tuple[dict[int, list[str]], int]:
    """Each size's texts, one per repeat (both servers get the same text in a repeat, no request the same text as
    another to the same server), and the model's trained context. Sizes whose prompt and answer would not fit it
    are skipped with a line saying so."""
    loop = RawLoop(path, n_ctx=512, threads=1)
    try:
        import llama_cpp

        trained = llama_cpp.llama_model_n_ctx_train(loop.model)
        raw = llama_cpp.llama_model_chat_template(loop.model, None)
        template = raw.decode() if raw else None
        overhead = len(loop.tokenize(render_chat(template, [{"role": "user", "content": ""}])))
        texts: dict[int, list[str]] = {}
        for size in sizes:
            if size + DECODE_TOKENS > trained:
                log(f"prompts: {size} tokens skipped, the model was trained for {trained}")
                continue
            texts[size] = [
                code_lines(size - overhead, seed=size * 1000 + r, count=loop.tokenize) for r in range(repeats)
            ]
        return texts, trained
    finally:
        loop.close()


def code_lines(tokens: int, *, seed: int, count: Callable[[str], list[int]]) -> str:
    """Numbered lines of code-like text from `seed`, as close under `tokens` tokens as whole lines come, the seed in
    the first line so two seeds' texts part at once."""
    rng = random.Random(seed)
    lines = [f"Request {seed}: read these numbered lines of code, then continue the last one."]
    while len(count("\n".join(lines))) < tokens:
        lines += [_code_line(rng, len(lines) + i) for i in range(32)]
    while len(lines) > 1 and len(count("\n".join(lines))) > tokens:
        lines.pop()
    return "\n".join(lines)


def _code_line(rng: random.Random, i: int) -> str:
    verb, noun, other = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(NOUNS)
    k, a, b = rng.randrange(1000), rng.randrange(1, 10**6), rng.randrange(1, 10**4)
    shapes = (
        f"def {verb}_{noun}_{k}(self, {other}: {rng.choice(TYPES)}) -> {rng.choice(TYPES)}: "
        f"return {other} {rng.choice(OPS)} {a}",
        f"{noun}_{k} = {{'{other}': {a}, '{verb}': [{b}, {rng.randrange(99)}, {rng.randrange(9999)}]}}",
        f"if {noun}.{verb}({a}) > {b}: raise ValueError('{other} {verb} failed at {k}')",
        f"for {other[0]}{k} in range({b}): total += {other[0]}{k} {rng.choice(OPS)} {a}  # {verb} the {noun}",
    )
    return f"{i:05d}  {rng.choice(shapes)}"


def chat_run(base: str, text: str, n: int) -> PromptRun:
    """`text` as one user message through /v1/chat/completions, streamed, greedy, `n` tokens with EOS ignored (both
    servers take llama.cpp's `ignore_eos`), usage asked for in the last chunk."""
    body = {
        "model": "bench",  # served_model's name for it; llama-server serves the one model it has
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    run = PromptRun(time.perf_counter())
    with rest.http_client().stream("POST", f"{base}/v1/chat/completions", json=body, timeout=1800) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{base} answered {resp.status_code}: {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                _take(run, json.loads(line[len("data: ") :]))
    if not run.arrivals:
        raise RuntimeError(f"{base} streamed no text for a {len(text)}-character prompt")
    return run


def _take(run: PromptRun, chunk: dict) -> None:
    if usage := chunk.get("usage"):
        run.prompt_tokens = usage.get("prompt_tokens", 0)
        run.completion_tokens = usage.get("completion_tokens", 0)
    choices = chunk.get("choices") or [{}]
    if (choices[0].get("delta") or {}).get("content"):
        run.arrivals.append(time.perf_counter())


def _figures(runs: dict[int, SizeRuns], trained: int) -> list[Figure]:
    figures = []
    curve = _curve(runs)
    for size, both in runs.items():
        label = f"{size // 1024}K" if size % 1024 == 0 else str(size)
        n = len(both.ours)
        common = f"both servers at their defaults, streamed /v1/chat/completions, distinct text; median of {n}"
        tokens = _median(both.ours, _prompt_tokens), _median(both.theirs, _prompt_tokens)
        prompt = f"prompt {tokens[0]:.0f} tokens (llama-server {tokens[1]:.0f})"
        cost = (
            f"s per 1K prompt tokens: ours {_median(both.ours, PromptRun.seconds_per_1k):.2f}, "
            f"llama-server {_median(both.theirs, PromptRun.seconds_per_1k):.2f}"
        )
        last = size == max(runs)
        figures.append(
            Figure(
                f"long prompt {label}: time to first token",
                _median(both.ours, PromptRun.ttft),
                _median(both.theirs, PromptRun.ttft),
                "s",
                TTFT_TARGET,
                lower_is_better=True,
                note=f"{prompt}; {cost}; {common}" + (f"; cost curve {curve}" if last else ""),
            )
        )
        figures.append(
            Figure(
                f"long prompt {label}: decode after it",
                _median(both.ours, PromptRun.decode_rate),
                _median(both.theirs, PromptRun.decode_rate),
                "tok/s",
                DECODE_TARGET,
                note=f"{DECODE_TOKENS} tokens, greedy, EOS ignored, after the {prompt}; {common}; "
                f"model trained for {trained}",
            )
        )
    return figures


def _median(runs: list[PromptRun], measure: Callable[[PromptRun], float]) -> float:
    return statistics.median(measure(run) for run in runs)


def _prompt_tokens(run: PromptRun) -> float:
    return run.prompt_tokens


def _curve(runs: dict[int, SizeRuns]) -> str:
    """Seconds per 1K prompt tokens at each size, ours then llama-server's: how prefill's cost grows with length."""
    ours = ", ".join(f"{_median(r.ours, PromptRun.seconds_per_1k):.2f}" for r in runs.values())
    theirs = ", ".join(f"{_median(r.theirs, PromptRun.seconds_per_1k):.2f}" for r in runs.values())
    return f"(at {', '.join(str(s) for s in runs)} tokens): ours {ours}; llama-server {theirs}"
