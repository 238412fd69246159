"""The step budget: how many prefill tokens a step may carry beside its decode rows, sized by time, not tokens.

A prefill chunk sized in tokens (num_batch) takes seconds on a slow CPU, and every decoding stream waits for it. As
stall-free schedulers do (Sarathi-Serve, vLLM's chunked prefill), a step that has decode rows gets them all first,
then as many prefill tokens as fit a time budget; a step with no decode rows (a lone prefill) takes the whole
num_batch, so its prompt is read as fast as before.

The budget comes from the engine's own step timings: StepCosts fits seconds = base + per_token x tokens to the latest
steps of each size (plain data; the engine thread feeds it). A mixed step is sized so that its decode rows cost at most
DECODE_SHARE of it: the prefill pays a small share of each step for the pacing, and a decoder waits a bounded
multiple of a plain decode step however long the prompt beside it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

PER_SIZE = 16  # the latest steps of each size (by powers of two) the fit reads: recent enough to follow the load
MIN_SAMPLES = 8
SPREAD = 2  # the largest step in the window must have this many times the tokens of the smallest to fit a slope
DECODE_SHARE = 0.05  # a mixed step is at least (its decode rows' cost / this) long
MIN_CHUNK = 16  # a prefill always advances by at least this many tokens a step (or what is left of the room)


@dataclass(frozen=True)
class Line:
    """A step's predicted wall time: base + per_token x tokens, in seconds."""

    base: float
    per_token: float

    def seconds(self, tokens: int) -> float:
        return self.base + self.per_token * tokens


class StepCostModel(Protocol):
    """What a step of some size costs: learnt from measured steps (StepCosts), or given (a test's fixed figures)."""

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` batch rows took `seconds` of wall time."""

    def fit(self) -> Line | None:
        """The cost line, or None while too little is known."""


@dataclass
class StepCosts:
    """Least squares over the latest samples of each step size (sizes grouped by powers of two, PER_SIZE samples
    each); None until they span sizes SPREAD apart. By size, so that the few long steps a prompt brings are still
    known after hundreds of decode-only steps, and each size follows the machine's latest speed."""

    per_size: int = PER_SIZE
    sizes: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        self.sizes.setdefault(tokens.bit_length(), deque(maxlen=self.per_size)).append((tokens, seconds))

    def fit(self) -> Line | None:
        samples = [sample for size in self.sizes.values() for sample in size]
        if len(samples) < MIN_SAMPLES:
            return None
        sizes = [n for n, _ in samples]
        if max(sizes) < SPREAD * min(sizes):
            return None
        count = len(samples)
        mean_n = sum(sizes) / count
        mean_t = sum(t for _, t in samples) / count
        var = sum((n - mean_n) ** 2 for n in sizes)
        cov = sum((n - mean_n) * (t - mean_t) for n, t in samples)
        per_token = cov / var
        if per_token <= 0:  # noise swamped the slope (a busy machine): no basis for a budget
            return None
        return Line(base=max(0.0, mean_t - per_token * mean_n), per_token=per_token)


class Pacing(Protocol):
    """The scheduler's view of the step budget."""

    def prefill_tokens(self, decode_rows: int, room: int) -> int:
        """How many prefill tokens a step with `decode_rows` decode rows may carry, of the `room` left in the batch."""

    def observe(self, tokens: int, seconds: float) -> None:
        """A decoded step's size and wall time."""


@dataclass
class StepBudget:
    """Decode rows first, then the prefill tokens that fit a step DECODE_SHARE of which is the decode rows' cost."""

    costs: StepCostModel = field(default_factory=StepCosts)
    decode_share: float = DECODE_SHARE
    min_chunk: int = MIN_CHUNK

    def observe(self, tokens: int, seconds: float) -> None:
        self.costs.observe(tokens, seconds)

    def step_seconds(self, decode_rows: int) -> float | None:
        """The time a step with `decode_rows` decode rows may take (None: nothing learnt yet)."""
        line = self.costs.fit()
        return None if line is None else line.seconds(decode_rows) / self.decode_share

    def prefill_tokens(self, decode_rows: int, room: int) -> int:
        if decode_rows <= 0 or room <= 0:
            return max(0, room)  # a lone prefill: nobody waits for it, so it takes the whole step
        line = self.costs.fit()
        if line is None:
            return room  # no timings yet: token-sized chunks, as without a budget
        spare = line.seconds(decode_rows) / self.decode_share - line.seconds(decode_rows)
        fits = int(spare / line.per_token)
        return min(room, max(self.min_chunk, fits))
