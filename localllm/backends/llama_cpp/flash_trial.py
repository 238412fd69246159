"""Flash attention on a CPU: measured once per model and machine, in a child started in the background after the
load probe (probe.py), applied from the next load.

llama.cpp's default ("auto") turns flash attention on wherever the device has the kernel, CPUs included. On a CPU
that is not always faster: for a model with small heads (smollm2's 64) short batches and decode steps deep in the
context are much slower with it, while one with large heads (gemma3's 256) is level or better with it. Which one wins
depends on the model's shapes and the CPU, so the child times both at a depth it can afford, and the pool turns it
off for that model when off is clearly faster (docs/benchmark-notes.md, "flash attention" and "figures kept out of
the code").

The trial fills a context of each kind to `depth` tokens, then alternates the two for a few rounds of the steps a
conversation spends its time in after the first turn: a short batch (a returning turn's new tokens) and a single
token (generation), each at that depth. The fastest of each is kept: a busy machine slows steps, it never speeds
them up. Big models on few cores cannot afford a meaningful depth in the time allowed; they keep llama.cpp's choice."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ... import api
from ...machine import physical_cores

if TYPE_CHECKING:
    from .backend import LlamaCppModel

TRIAL_SECONDS = 1.0  # the most one setting's prefill to `depth` may take, from the first chunk's speed
MIN_DEPTH = 128  # shallower, attention is too small a share of a step to tell the two apart
MAX_DEPTH = 256  # deep enough to show the difference clearly (it grows with depth)
FIRST_CHUNK = 32  # tokens timed first, to size the depth
# A single token costs more than a token in a batch: slower than this, no batch can reach MIN_DEPTH in time.
ONE_TOKEN_LIMIT = 8 * TRIAL_SECONDS / MIN_DEPTH
SHORT_BATCH = 16
ROUNDS = 3
OFF_FASTER = 0.8  # off must take at most this share of on's time at depth...
PREFILL_SLACK = 1.25  # ...and its prefill no more than this multiple of on's


@dataclass(frozen=True)
class StepTimes:
    """Seconds, the fastest of the rounds: prefill to the depth, a short batch and one token at that depth."""

    prefill: float
    short_batch: float
    one_token: float

    @property
    def at_depth(self) -> float:
        return self.short_batch + self.one_token


@dataclass(frozen=True)
class FlashTrial:
    depth: int
    threads: int
    on: StepTimes
    off: StepTimes

    @property
    def flash_attn(self) -> bool | None:
        """False when off is clearly faster at depth without costing much prefill; None leaves llama.cpp's choice."""
        clearly_faster = self.off.at_depth <= OFF_FASTER * self.on.at_depth
        return False if clearly_faster and self.off.prefill <= PREFILL_SLACK * self.on.prefill else None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> FlashTrial | None:
        """None for anything that is not a trial this code wrote (an old or edited memory file)."""
        try:
            assert isinstance(data, dict)
            return cls(
                depth=int(data["depth"]),
                threads=int(data["threads"]),
                on=StepTimes(**data["on"]),
                off=StepTimes(**data["off"]),
            )
        except (AssertionError, KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        threads = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        return (
            f"at depth {self.depth} on {threads}: flash attention on {self.on.at_depth * 1000:.1f} ms, off "
            f"{self.off.at_depth * 1000:.1f} ms (a {SHORT_BATCH}-token batch and one token); prefill on "
            f"{self.on.prefill * 1000:.0f} ms, off {self.off.prefill * 1000:.0f} ms"
        )


def affordable_depth(seconds_per_token: float) -> int:
    """The deepest trial (a multiple of FIRST_CHUNK, at most MAX_DEPTH) whose prefill fits TRIAL_SECONDS; 0 when
    even MIN_DEPTH does not."""
    tokens = int(TRIAL_SECONDS / max(seconds_per_token, 1e-9)) // FIRST_CHUNK * FIRST_CHUNK
    depth = min(tokens, MAX_DEPTH)
    return depth if depth >= MIN_DEPTH else 0


def wanted(load: api.LoadOptions) -> bool:
    """Only where the choice is left open, with a cache flash attention is optional for (a quantized V needs it) and
    no RPC workers (their devices decide)."""
    return load.flash_attn is None and (load.kv_type or "f16") == "f16" and not load.rpc


def _on_cpu(model: LlamaCppModel) -> bool:
    return model.placement is None or model.placement.n_gpu_layers == 0


def run_trial(weights: Path, load: api.LoadOptions) -> FlashTrial | None:
    """Time both settings on `weights` (loaded twice, sharing the weights); None when layers run off the CPU or no
    useful depth is affordable."""
    from .backend import LlamaCppBackend

    n_ctx = MAX_DEPTH + 2 * SHORT_BATCH
    options = load.model_copy(update={"num_ctx": n_ctx, "num_parallel": 1, "draft": None, "embedding": False})
    backend = LlamaCppBackend()
    models: dict[bool, LlamaCppModel] = {}
    try:
        for flash in (True, False):
            models[flash] = backend.load(weights, options.model_copy(update={"flash_attn": flash}))
        if not _on_cpu(models[True]):
            return None
        tokens = _tokens(models[True].meta.n_vocab, MAX_DEPTH + SHORT_BATCH)
        for model in models.values():  # a context's first decode sets up its buffers: not what is measured
            _timed(model, tokens[:1], 0)
        threads, depth = _affordable(models, tokens)
        if depth == 0:
            return None
        prefill = {flash: _prefill(model, tokens[:depth]) for flash, model in models.items()}
        short: dict[bool, list[float]] = {True: [], False: []}
        one: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ROUNDS):  # alternating, so that a change in the machine's load touches both alike
            for flash, model in models.items():
                short[flash].append(_timed(model, tokens[depth : depth + SHORT_BATCH], depth))
                one[flash].append(_timed(model, tokens[depth : depth + 1], depth))
        times = {flash: StepTimes(prefill[flash], min(short[flash]), min(one[flash])) for flash in models}
        return FlashTrial(depth=depth, threads=threads, on=times[True], off=times[False])
    finally:
        for model in models.values():
            model.close()


def _affordable(models: dict[bool, LlamaCppModel], tokens: list[int]) -> tuple[int, int]:
    """The threads and depth of the trial: every core the load would start with, or one where that is too slow for
    any useful depth (other work on the CPU makes llama.cpp's threads wait for each other at every step)."""
    first = models[True]
    for threads in dict.fromkeys((first.options.num_thread or physical_cores(), 1)):
        for model in models.values():
            model.threads.set(threads)
        if _timed(first, tokens[:1], 0) > ONE_TOKEN_LIMIT:  # a big model: even the sizing chunk would cost seconds
            continue
        for model in models.values():  # the first batch of a size sets up more than its steps cost later
            _timed(model, tokens[:SHORT_BATCH], 0)
        depth = affordable_depth(_timed(first, tokens[:FIRST_CHUNK], 0) / FIRST_CHUNK)
        if depth:
            return threads, depth
    return 1, 0


def _tokens(n_vocab: int, n: int) -> list[int]:
    # Any tokens do: the cost of a step does not depend on which; spread over the vocabulary, away from the specials.
    return [(7 * i + 11) % n_vocab for i in range(n)]


def _prefill(model: LlamaCppModel, tokens: list[int]) -> float:
    model.remove(0, 0)
    start = time.perf_counter()
    for begin in range(0, len(tokens), model.n_batch):
        _decode(model, tokens[begin : begin + model.n_batch], begin)
    return time.perf_counter() - start


def _timed(model: LlamaCppModel, tokens: list[int], pos: int) -> float:
    """Seconds to decode `tokens` at `pos` and read the last row, which is then forgotten again."""
    start = time.perf_counter()
    _decode(model, tokens, pos)
    seconds = time.perf_counter() - start
    model.remove(0, pos)
    return seconds


def _decode(model: LlamaCppModel, tokens: list[int], pos: int) -> None:
    from ..base import Batch

    batch = Batch()
    for i, token in enumerate(tokens):
        batch.add(token, pos + i, 0, i == len(tokens) - 1)
    model.decode(batch)
    model.logits(len(tokens) - 1)
