"""MLX served: `localllm serve` on an MLX model against `mlx_lm.server` at its defaults, on the very same converted
files, the same chat requests over /v1/chat/completions, one stream and four concurrent ones, interleaved; then our
own four streams in one batched forward against one slot (serial), and a returning turn's first token (the prefix
cache) against a cold one."""

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


def mlx_bench_home(gguf: Path, home: Path, *, name: str = MODEL, quantize: str | None = None) -> Path:
    """Store `gguf` in `home` and create `name` from it with `--format mlx` (and `--quantize`), as a user would; the
    MLX folder the store builds for it (the files both servers load)."""
    from ..api import CreateRequest
    from ..models.create import create_model
    from ..models.store import Store
    from .rest import create_bench_model

    create_bench_model(gguf, home, name=f"{name}-gguf")
    store = Store(home / "models")
    request = CreateRequest(model=name, **{"from": f"{name}-gguf"}, format="mlx", quantize=quantize)
    list(create_model(request, store))
    return Path(store.resolve(name).weights)


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
    """Stream each prompt as a user message through /v1/chat/completions at once, greedy, up to `n` tokens."""
    return conversations_run(base, model, [[{"role": "user", "content": prompt}] for prompt in prompts], n)


def conversations_run(base: str, model: str, conversations: list[list[dict[str, str]]], n: int) -> EngineRun:
    """Stream each conversation through /v1/chat/completions at once, greedy, up to `n` tokens; every chunk that
    carries text counts as one token (both servers send one per token)."""

    def one(i: int, run: EngineRun) -> None:
        body = {"model": model, "messages": conversations[i], "max_tokens": n, "temperature": 0, "stream": True}
        with http_client().stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    run.received(i, [0])

    return concurrent_streams(EngineRun.start(len(conversations)), one)


def returning_turn(base: str, model: str, k: int, n: int) -> tuple[float, float]:
    """(a cold first token, the returning turn's first token) on a conversation no earlier request began: the
    first turn's ~500-token prompt is new (its number leads it), the second repeats it with the answer and asks on."""
    document = f"Notes {k}. " + " ".join(f"Line {i}: the keeper lit lamp {i} at dusk and logged it." for i in range(40))
    first = [{"role": "user", "content": f"{document}\nSummarise these notes."}]
    cold = conversations_run(base, model, [first], n).ttft()
    again = [*first, {"role": "assistant", "content": "The keeper lit the lamps."}, {"role": "user", "content": "Why?"}]
    return cold, conversations_run(base, model, [again], n).ttft()


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
            log("MLX served: a returning turn's first token")
            turns = [returning_turn(ours, MODEL, k, 4) for k in range(repeats)]
        log("MLX served: four streams, batched against one slot")
        serial = _batched_against_serial(gguf, home, four, n, repeats)
    return [
        one.figure("MLX single stream: ours vs mlx_lm.server", 0.95, note=note),
        many.figure("MLX 4 concurrent streams (aggregate): ours vs mlx_lm.server", 1.0, note=note),
        serial,
        Figure(
            "MLX returning turn's first token vs a cold one (prefix cache)",
            max(returning for _, returning in turns),
            max(cold for cold, _ in turns),
            "s",
            0.2,
            lower_is_better=True,
            note=f"ours; a new ~500-token conversation in each of {repeats} repeats, then its next turn; the worst",
        ),
    ]


def _batched_against_serial(gguf: Path, home: Path, prompts: list[str], n: int, repeats: int) -> Figure:
    """Our four streams on four slots (one batched forward a step) against the same four on one slot, served one
    after another: every token over the time from submission, alternating, the worst repeat of each."""
    batched, serial = [], []
    with served_model(gguf, slots=4, threads=None, n_ctx=2048, home=home) as four:
        chat_run(four, MODEL, prompts, 8)
        with served_model(gguf, slots=1, threads=None, n_ctx=2048, home=home) as one:
            chat_run(one, MODEL, prompts[:1], 8)
            for _ in range(repeats):
                serial.append(chat_run(one, MODEL, prompts, n).throughput())
                batched.append(chat_run(four, MODEL, prompts, n).throughput())
    return Figure(
        "MLX 4 streams (aggregate): 4 slots, one batched forward vs 1 slot (serial)",
        min(batched),
        max(serial),
        "tok/s",
        2.0,
        note=f"ours on both sides, greedy, up to {n} tokens, every token over the time from submission; the worst "
        f"batched repeat of {repeats} against the best serial one",
    )


PAIR_PROMPT = "Explain what a Python decorator is and when to use one, with a short example."


def run_mlx_pair_benchmarks(
    target: Path, draft: Path, *, n: int = 32, repeats: int = 3, log: Callable[[str], None] = print
) -> list[Figure]:
    """A real draft pair on MLX (both GGUFs converted by `create --format mlx --quantize q4`): our engine with the
    draft model against itself with speculation off, one stream, greedy, each draft run between two plain ones. The
    first draft run is the first request that may draft since the load, where a draft model's first trial would
    cost the most; the figure is the worst repeat, as the issue asks never below off."""
    from ..api import LoadOptions
    from ..backends.mlx import MlxBackend
    from ..engine.runner import ModelEngine
    from ..engine.speculative.speculation import Speculation, open_draft_model
    from .engine import engine_run, user_turn_tokens

    with tempfile.TemporaryDirectory(prefix="localllm-mlx-pair-") as tmp:
        home = Path(tmp)
        log("MLX pair: converting both GGUFs (create --format mlx --quantize q4)")
        target_folder = mlx_bench_home(target, home, name="pair-target", quantize="q4")
        draft_folder = mlx_bench_home(draft, home, name="pair-draft", quantize="q4")
        load = LoadOptions(num_ctx=1024, num_parallel=1)
        model = MlxBackend().load(target_folder, load)
        speculation = Speculation(model, draft=open_draft_model(draft_folder, load, model, name="pair-draft"))
        engine = ModelEngine(model, max_queue=4, speculation=speculation)
        try:
            prompt = user_turn_tokens(engine, PAIR_PROMPT)
            log(f"MLX pair: prefilling the {len(prompt)}-token prompt once (the runs reuse it)")
            engine_run(engine, [prompt], 2)
            runs = []
            for i in range(repeats):
                log(f"MLX pair: repeat {i + 1}/{repeats} (off, draft, off)")
                before = engine_run(engine, [prompt], n).rate()
                drafted = engine_run(engine, [prompt], n, spec_type="draft").rate()
                runs.append((before, drafted, engine_run(engine, [prompt], n).rate()))
            stats = engine.snapshot()
            cost = speculation.cost.describe()
            price = speculation.draft_model.seconds_per_token if speculation.draft_model else 0.0
        finally:
            engine.close()
    before, drafted, after = min(runs, key=lambda run: run[1] / ((run[0] + run[2]) / 2))
    return [
        Figure(
            "MLX draft model (0.5B for 1.5B) vs off, worst repeat",
            drafted,
            (before + after) / 2,
            "tok/s",
            1.0,
            noise=abs(1 - after / before),
            note=f"ours on both sides, one stream, greedy, {n} tokens, a {len(prompt)}-token chat prompt; each repeat "
            f"{' '.join(f'{d / ((b + a) / 2):.2f}' for b, d, a in runs)} (the first is the first drafting request "
            f"after the load); {stats.draft_tokens} draft tokens verified, {stats.accepted_tokens} accepted; a "
            f"target step costs {cost}, a draft token {price * 1e3:.0f} ms (the wall clock)",
        )
    ]
