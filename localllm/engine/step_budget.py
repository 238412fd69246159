"""The step budget: how many prefill tokens a step may carry beside its decode rows, sized by time, not tokens.

A prefill chunk sized in tokens (num_batch) takes seconds on a slow CPU, and every decoding stream waits for it. As
stall-free schedulers do (Sarathi-Serve, vLLM's chunked prefill), a step with decode rows gets them all first, then as
many prefill tokens as fit a time budget; a lone prefill takes the whole num_batch. StepCosts fits seconds = base +
per_token x tokens to the engine's latest steps; a mixed step carries the fewest prefill tokens at which, by that line,
the prompt's tokens cost at most PREFILL_SLOWDOWN more each than alone (the whole step charged to the prompt). The
bound is tight because what the line leaves out costs the prompt more (docs/benchmark-notes.md, "The step budget")."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

PER_SIZE = 16  # the latest steps of each size (by powers of two) the fit reads: recent enough to follow the load
MIN_SAMPLES = 8
SPREAD = 2  # the largest step in the window must have this many times the tokens of the smallest to fit a slope
PREFILL_SLOWDOWN = 0.02  # by the line, a prompt beside decoders costs each token at most this much more than alone
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

    def observe(self, tokens: int, seconds: float, *, chunk: bool) -> None:
        """A step of `tokens` batch rows took `seconds` of wall time; `chunk`: it carried a prefill chunk."""

    def fit(self) -> Line | None:
        """The cost line that sizes prefill chunks, or None while too little is known."""


class _Window:
    """The latest samples of each step size (by powers of two), and the least-squares line through them."""

    def __init__(self, per_size: int):
        self.per_size = per_size
        self.sizes: dict[int, deque[tuple[int, float]]] = {}

    def add(self, tokens: int, seconds: float) -> None:
        self.sizes.setdefault(tokens.bit_length(), deque(maxlen=self.per_size)).append((tokens, seconds))

    def line(self) -> Line | None:
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


class StepCosts:
    """Least squares over the latest samples of each step size (sizes grouped by powers of two, PER_SIZE samples
    each); None until they span sizes SPREAD apart. By size, so that the few long steps a prompt brings are still
    known after hundreds of decode-only steps, and each size follows the machine's latest speed.

    Steps that carry a prefill chunk have a line of their own, and the fit is whichever line has the larger base:
    decode-only steps (llama.cpp's matrix-vector path) lie well under the chunks' line, and where attention dominates
    the chunks' own line reads no base at all; too small a base sizes chunks that each pay the step's fixed cost
    again (docs/benchmark-notes.md, "The step budget")."""

    def __init__(self, per_size: int = PER_SIZE):
        self._all = _Window(per_size)
        self._chunks = _Window(per_size)

    def observe(self, tokens: int, seconds: float, *, chunk: bool) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        self._all.add(tokens, seconds)
        if chunk:
            self._chunks.add(tokens, seconds)

    def fit(self) -> Line | None:
        lines = [line for line in (self._chunks.line(), self._all.line()) if line is not None]
        return max(lines, key=lambda line: line.base, default=None)


class Pacing(Protocol):
    """The scheduler's view of the step budget."""

    def prefill_tokens(self, decode_rows: int, room: int) -> int:
        """How many prefill tokens a step with `decode_rows` decode rows may carry, of the `room` left in the batch."""

    def observe(self, tokens: int, seconds: float, *, chunk: bool) -> None:
        """A decoded step's size and wall time; `chunk`: it carried a prefill chunk."""


@dataclass
class StepBudget:
    """Decode rows first, then the fewest prefill tokens at which the prompt's tokens cost at most `slowdown` more
    each than in full chunks of the batch (decode rows + room)."""

    costs: StepCostModel = field(default_factory=StepCosts)
    slowdown: float = PREFILL_SLOWDOWN
    min_chunk: int = MIN_CHUNK

    def observe(self, tokens: int, seconds: float, *, chunk: bool) -> None:
        self.costs.observe(tokens, seconds, chunk=chunk)

    def prefill_tokens(self, decode_rows: int, room: int) -> int:
        if decode_rows <= 0 or room <= 0:
            return max(0, room)  # a lone prefill: nobody waits for it, so it takes the whole step
        line = self.costs.fit()
        if line is None:
            return room  # no timings yet: token-sized chunks, as without a budget
        # A step of d decode rows and n prompt tokens costs base + per_token (d + n), all charged to the prompt; alone
        # its tokens cost (base / full + per_token) each. The first no dearer than (1 + slowdown) times the second:
        #   n >= (base + per_token d) / (slowdown per_token + (1 + slowdown) base / full).
        full = decode_rows + room
        alone = line.base / full + line.per_token
        fits = line.seconds(decode_rows) / ((1 + self.slowdown) * alone - line.per_token)
        return min(room, max(self.min_chunk, int(fits) + 1))
