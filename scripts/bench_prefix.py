"""The prefix-cache section of scripts/bench.py: more conversations than slots (issue 19).

Six conversations, each with its own ~1,000-token system prompt, on 2 slots, in round-robin turns, all through the
REST server (raw prompt tokens over /api/generate, as an agent resending its history would):

    returning turn          mean time to first token of a conversation's later turns (its slot was taken by others
                            since) against the mean of the first turns, same run (target <= 0.1)
    after a restart         the server stopped and started on the same home (LOCALLLM_CACHE_DISK on): one more round,
                            against the same first turns (target <= 0.35)
    llama-server            the same prompt tokens on llama.cpp's own server with its default --cache-ram, 2 slots:
                            our returning turn against its returning turn (target <= 0.67, i.e. 1.5x faster);
                            skipped with a note when no llama-server binary is given

Time to first token is taken on the client's clock, from sending the request to its first token. Each turn asks for
a short greedy answer (EOS ignored), and the next turn's prompt is the previous prompt, that answer's tokens and a new
question, so both servers see exactly the same tokens."""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from localllm.bench.figures import Figure
from localllm.bench.raw import RawLoop
from localllm.bench.rest import http_client, served_model

CONVERSATIONS = 6
SLOTS = 2
SYSTEM_TOKENS = 1000
ROUNDS = 3  # the first turns, then returning turns
ANSWER_TOKENS = 16
N_CTX = 4096
WORDS = (
    "river harbour lantern copper meadow orchard signal ledger engine canvas thunder pebble violin granite "
    "compass saddle timber falcon quarry ribbon glacier beacon mortar anchor willow cobalt saffron tundra "
    "marble cinder basalt prairie furnace hollow kestrel linen maple nectar oyster parchment quiver russet "
    "sable tallow umber vellum walnut yarrow zephyr amber bramble cedar delta ember fern grove heron"
).split()
QUESTIONS = [
    "Summarise the rules above in one line.",
    "What should I do first?",
    "Give me one more example.",
    "What is the most important rule?",
    "Anything else I should know?",
]

Turn = Callable[[list[int]], tuple[float, list[int]]]  # prompt tokens -> (seconds to first token, answer tokens)


def system_prompt(tokenize: Callable[[str], list[int]], index: int) -> list[int]:
    """Conversation `index`'s own system prompt: rules made of seeded words, about SYSTEM_TOKENS tokens long."""
    rng = random.Random(index)
    text = f"You are assistant number {index}. Follow these house rules.\n"
    rule = 0
    while len(tokenize(text)) < SYSTEM_TOKENS:
        rule += 1
        text += f"Rule {rule}: " + " ".join(rng.choice(WORDS) for _ in range(24)) + ".\n"
    return tokenize(text)


def conversations(path: Path) -> tuple[list[list[int]], Callable[[int, int], list[int]]]:
    """(each conversation's system prompt tokens, question(conversation, round) -> that turn's new tokens)."""
    import llama_cpp

    loop = RawLoop(path, n_ctx=N_CTX, threads=1)
    bos = llama_cpp.llama_vocab_bos(loop.vocab)

    def continuation(text: str) -> list[int]:  # mid-conversation text: no BOS
        tokens = loop.tokenize(text)
        return tokens[1:] if tokens and tokens[0] == bos else tokens

    try:
        systems = [system_prompt(loop.tokenize, i) for i in range(CONVERSATIONS)]
        questions = {
            (i, r): continuation(f"\nUser: {QUESTIONS[(i + r) % len(QUESTIONS)]}\nAssistant:")
            for i in range(CONVERSATIONS)
            for r in range(ROUNDS + 1)
        }
    finally:
        loop.close()
    return systems, lambda i, r: questions[(i, r)]


def play(
    turn: Turn, systems: list[list[int]], question, histories: list[list[int]] | None, rounds: range
) -> tuple[dict[int, list[float]], list[list[int]]]:
    """Round-robin turns: {round: each conversation's time to first token}, and the histories to go on from."""
    histories = histories or [list(s) for s in systems]
    ttft: dict[int, list[float]] = {}
    for r in rounds:
        for i in range(len(systems)):
            prompt = histories[i] + question(i, r)
            seconds, answer = turn(prompt)
            ttft.setdefault(r, []).append(seconds)
            histories[i] = prompt + answer
    return ttft, histories


def ours_turn(base: str) -> Turn:
    def turn(prompt: list[int]) -> tuple[float, list[int]]:
        body = {
            "model": "bench",
            "prompt": "",
            "context": prompt,
            "raw": True,
            "stream": True,
            "options": {"temperature": 0, "num_predict": ANSWER_TOKENS, "spec_type": "none", "ignore_eos": True},
        }
        t0, first, tokens = time.perf_counter(), None, []
        with http_client().stream("POST", f"{base}/api/generate", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                chunk = json.loads(line)
                if chunk.get("tokens"):
                    first = first or time.perf_counter()
                    tokens.extend(chunk["tokens"])
        return (first or time.perf_counter()) - t0, tokens

    return turn


def llama_server_turn(server) -> Turn:
    def turn(prompt: list[int]) -> tuple[float, list[int]]:
        t0, marks, tokens = time.perf_counter(), [], []

        def received(chunk: list[int]) -> None:
            marks.append(time.perf_counter())
            tokens.extend(chunk)

        server.stream(prompt, ANSWER_TOKENS, received, ignore_eos=True)
        return (marks[0] if marks else time.perf_counter()) - t0, tokens

    return turn


def returning(ttft: dict[int, list[float]]) -> float:
    return statistics.mean(t for r, times in ttft.items() if r > 0 for t in times)


@contextmanager
def llama_server(binary: str, path: Path, threads: int) -> Iterator[object]:
    import bench_spec

    # llama-server at its defaults (its --cache-ram included): only the slots and the context are ours.
    server = bench_spec.LlamaServer(binary, path, threads=threads, spec=None, slots=SLOTS, ctx_per_slot=N_CTX)
    try:
        yield server
    finally:
        server.close()


def prefix_figures(
    path: Path, *, threads: int | None, llama_server_binary: str | None, log: Callable[[str], None] = print
) -> list[Figure]:
    from localllm import config
    from localllm.machine import physical_cores

    threads = threads or config.NUM_THREAD.get() or physical_cores()
    systems, question = conversations(path)
    http_client()  # built before the first timed turn
    setting = {"LOCALLLM_CACHE_DISK": "4GiB"}
    scenario = f"{CONVERSATIONS} conversations of ~{SYSTEM_TOKENS}-token system prompts on {SLOTS} slots"
    with tempfile.TemporaryDirectory(prefix="localllm-bench-prefix-") as home:
        log(f"prefix cache: {scenario}, {ROUNDS} round-robin rounds")
        with served_model(path, slots=SLOTS, threads=threads, n_ctx=N_CTX, home=Path(home), env=setting) as base:
            ttft, histories = play(ours_turn(base), systems, question, None, range(ROUNDS))
        log("prefix cache: the same server restarted on the same home, one more round")
        with served_model(path, slots=SLOTS, threads=threads, n_ctx=N_CTX, home=Path(home), env=setting) as base:
            after, _ = play(ours_turn(base), systems, question, histories, range(ROUNDS, ROUNDS + 1))
    first, back = statistics.mean(ttft[0]), returning(ttft)
    figures = [
        Figure(
            "returning turn vs first turn (TTFT)",
            back * 1000,
            first * 1000,
            "ms",
            0.1,
            lower_is_better=True,
            note=f"{scenario}; mean over rounds 2-{ROUNDS}, same run",
        ),
        Figure(
            "after a restart vs first turn (TTFT)",
            statistics.mean(after[ROUNDS]) * 1000,
            first * 1000,
            "ms",
            0.35,
            lower_is_better=True,
            note="server stopped and started on the same home, LOCALLLM_CACHE_DISK on",
        ),
    ]
    if not llama_server_binary:
        log("no llama-server binary (--llama-server or LLAMA_SERVER): its comparison is skipped")
        return figures
    log("prefix cache: llama-server with its default --cache-ram, the same conversations")
    with llama_server(llama_server_binary, path, threads) as server:
        server.complete(systems[0][:8], 4)  # warm up
        theirs, _ = play(llama_server_turn(server), systems, question, None, range(ROUNDS))
    figures.append(
        Figure(
            "returning turn: ours vs llama-server --cache-ram (TTFT)",
            back * 1000,
            returning(theirs) * 1000,
            "ms",
            0.67,
            lower_is_better=True,
            note=f"same prompt tokens; llama-server's first turn {statistics.mean(theirs[0]):.2f} s, "
            f"ours {first:.2f} s, both at {threads} thread(s)",
        )
    )
    return figures
