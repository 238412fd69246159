"""Editor completion: typing replayed against /infill, ours and llama-server's, both at their defaults on one GGUF.

An editor plugin (llama.vscode, llama.vim) sends one fill-in-the-middle request per keystroke and drops the one
before it. The replay retypes lines of a ~60-line Python file word by word: within a word each keystroke's request
cancels the previous one (its connection closed, as the plugin aborts it); after the word's last key the request
runs to its 16 tokens, and the time from its keystroke to its 16th token is one sample. Figures: p50 and p95 of those
times, ours against llama-server's (lower is better). The body is llama.vscode's layout: the lines before the
cursor line, the cursor line's start as `prompt`, the rest of the file as the suffix.

    python scripts/bench.py --models qwen2.5-coder:0.5b --only editor --llama-server PATH --no-write
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from localllm.bench.figures import Figure
from localllm.bench.rest import served_model

TOKENS = 16
KEY_INTERVAL = 0.06  # seconds between keystrokes within a word (a brisk typist)

SOURCE = '''"""A small inventory service: items, stock levels and reorder rules."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Item:
    sku: str
    name: str
    price: float
    stock: int = 0
    reorder_at: int = 5
    tags: list[str] = field(default_factory=list)

    def needs_reorder(self) -> bool:
        return self.stock <= self.reorder_at

    def value(self) -> float:
        return self.price * self.stock


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def remove(self, sku: str) -> Item:
        return self.items.pop(sku)

    def restock(self, sku: str, count: int) -> None:
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[sku].stock += count

    def sell(self, sku: str, count: int) -> float:
        item = self.items[sku]
        if count > item.stock:
            raise ValueError(f"only {item.stock} of {sku} left")
        item.stock -= count
        return item.price * count

    def to_reorder(self) -> list[Item]:
        return [item for item in self.items.values() if item.needs_reorder()]

    def total_value(self) -> float:
        return sum(item.value() for item in self.items.values())

    def save(self, path: Path) -> None:
        rows = [vars(item) for item in self.items.values()]
        path.write_text(json.dumps(rows, indent=2))

    @classmethod
    def load(cls, path: Path) -> Inventory:
        inventory = cls()
        for row in json.loads(path.read_text()):
            inventory.add(Item(**row))
        return inventory
'''

TYPED_LINES = (44, 48)  # the lines retyped (sell's body), 0-based, end excluded


def keystroke_bodies(source: str = SOURCE, lines: tuple[int, int] = TYPED_LINES) -> list[list[dict]]:
    """Requests per word: each keystroke's /infill body, the cursor moving through the retyped lines (their
    indentation comes at once, as an editor indents a new line)."""
    rows = source.splitlines(keepends=True)
    start, end = lines
    before, after = "".join(rows[:start]), "".join(rows[end:])
    words: list[list[dict]] = []
    done = ""  # whole lines typed so far
    for row in rows[start:end]:
        text = row.rstrip("\n")
        indent = text[: len(text) - len(text.lstrip())]
        for i, ch in enumerate(text[len(indent) :]):
            body = {
                "input_prefix": before + done,
                "prompt": text[: len(indent) + i + 1],
                "input_suffix": "\n" + after,
                "n_predict": TOKENS,
                "stream": True,
                "cache_prompt": True,
            }
            if i == 0 or ch == " ":
                words.append([])
            words[-1].append(body)
        done += row
    return words


async def _to_tokens(client, url: str, body: dict, sent: float) -> float:
    """Stream one request; the seconds from `sent` to its TOKENS-th token (or its end, if it stops sooner)."""
    count = 0
    async with client.stream("POST", url, json=body) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            count += len(event.get("tokens") or []) or (1 if event.get("content") else 0)
            if count >= TOKENS or event.get("stop"):
                return time.perf_counter() - sent
    return time.perf_counter() - sent


async def replay(url: str, words: list[list[dict]], model: str | None) -> list[float]:
    """Type every word; the latency of each word's last keystroke."""
    import httpx

    samples: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for word in words:
            previous: asyncio.Task | None = None
            for i, body in enumerate(word):
                if previous is not None:
                    previous.cancel()  # the editor drops the last keystroke's request: its connection closes
                payload = {**body, "model": model} if model else body
                task = asyncio.ensure_future(_to_tokens(client, url, payload, time.perf_counter()))
                if i < len(word) - 1:
                    previous = task
                    await asyncio.sleep(KEY_INTERVAL)
                else:
                    samples.append(await task)
            if previous is not None and not previous.done():
                previous.cancel()
    return samples


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def editor_figures(path: Path, *, llama_server: str | None) -> list[Figure]:
    from localllm import config

    words = keystroke_bodies()
    with served_model(path, slots=config.NUM_PARALLEL.get(), threads=None, n_ctx=config.CONTEXT_LENGTH.get()) as base:
        asyncio.run(replay(base + "/infill", words[:2], "bench"))  # warm up
        ours = asyncio.run(replay(base + "/infill", words, "bench"))
    note = f"{len(ours)} words typed, {sum(map(len, words))} keystrokes, each cancelling the one before"
    if llama_server is None:
        return [Figure("editor: time to 16 tokens p50", percentile(ours, 50) * 1e3, 0.0, "ms", None, note=note)]
    with _llama_server(llama_server, path) as url:
        asyncio.run(replay(url + "/infill", words[:2], None))
        theirs = asyncio.run(replay(url + "/infill", words, None))
    return [
        Figure(
            f"editor: time to 16 tokens p{q}",
            percentile(ours, q) * 1e3,
            percentile(theirs, q) * 1e3,
            "ms",
            1.0,
            lower_is_better=True,
            note=note,
        )
        for q in (50, 95)
    ]


@contextmanager
def _llama_server(binary: str, path: Path) -> Iterator[str]:
    import bench_spec

    server = bench_spec.LlamaServer(binary, path, threads=0, spec=None, defaults=True)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.close()
