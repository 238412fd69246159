"""The draft policy: what a decode step costs per row (StepCost), and how many draft tokens are worth verifying for
one request this step (DraftWindow and its runs). Pure arithmetic on plain numbers: no model, no native code."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class StepCost:
    """Seconds of a decode step of `rows` rows, all read out, modelled as a + b * rows: exponentially weighted least
    squares over decode-only steps (prefill rows run other kernels), each step weighted by its rows, under a light
    optimistic prior scaled to the first step (docs/benchmark-notes.md, "Rules in the code")."""

    BASELINE_ROWS = 64  # steps of up to this many rows also keep their own mean (see baseline)
    BASELINE_STEPS = 4.0  # a batch size's own mean is believed once this many steps of it are counted

    def __init__(self, *, prior: float = 0.05, memory: float = 0.999, fixed: float | None = None):
        # A long memory: what a few draft steps taught about the slope must outlive the same-sized steps between.
        self.prior = prior
        self.memory = memory
        self.fixed = fixed  # the step's fixed seconds where another depth measured them: the prior's split
        # (busy, drafted) -> decayed steps, tokens emitted and seconds; busy -> plain steps left before a new trial
        self._outcomes: dict[tuple[int, bool], tuple[float, float, float]] = {}
        self._rest: dict[int, int] = {}
        self._baseline: dict[int, tuple[float, float]] = {}  # rows -> (decayed steps, decayed seconds)
        # Decayed, row-weighted sums of the fit: weight, rows, rows², seconds, rows x seconds. Plain floats: this runs
        # after every decode step, and numpy's small arrays cost ten times more.
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)
        self._anchor: np.ndarray | None = None  # prior coefficients, once a step gave them a scale
        self._coef = np.array([1.0, prior])  # in one-row steps until something is measured
        self._stale = False

    def record(self, rows: int, outputs: int, seconds: float, *, row_hint: float | None = None) -> None:
        """A decode step of `rows` rows, all read out, took `seconds`; `row_hint`: what a prompt's row cost lately
        (seconds), which splits the first step between its fixed part and its rows where no other depth did."""
        if rows <= 0 or outputs != rows or seconds <= 0:
            return
        if self._anchor is None:
            self._anchor = self._first_anchor(rows, seconds, row_hint)
        # Each step weighs as many as its rows: large draft steps pay the slope, not the few small steps.
        m, w = self.memory, float(rows)
        n, sx, sxx, sy, sxy = self._sums
        self._sums = (
            m * n + w,
            m * sx + w * rows,
            m * sxx + w * rows * rows,
            m * sy + w * seconds,
            m * sxy + w * rows * seconds,
        )
        self._stale = True  # solved when a draft is next sized: steps with no speculating request never pay for it
        if rows <= self.BASELINE_ROWS:
            steps, total = self._baseline.get(rows, (0.0, 0.0))
            self._baseline[rows] = (self.memory * steps + 1.0, self.memory * total + seconds)

    OUTCOME_STEPS = 3.0  # decayed steps of each kind before their rates are compared
    DRAFT_MEMORY = 0.8  # draft steps: the last few decide
    REST_STEPS = 48  # plain steps a batch size goes without drafts once they lost, before a new trial

    def record_outcome(self, busy: int, *, drafted: bool, tokens: int, seconds: float) -> None:
        """What a decode step of `busy` requests yielded: tokens emitted in `seconds`, with drafts or without. Where
        the recent steps with drafts yielded fewer tokens a second than plain steps of the same batch, that batch
        size rests from drafts for REST_STEPS plain steps: the cost model's guess checked against what drafting
        delivered (a step's cost need not be linear in its rows: on a CPU deep in a context two rows cost more than
        twice one), so that no model of it makes speculation slower than none."""
        if busy <= 0 or seconds <= 0:
            return
        memory = self.DRAFT_MEMORY if drafted else self.memory
        steps, emitted, total = self._outcomes.get((busy, drafted), (0.0, 0.0, 0.0))
        self._outcomes[(busy, drafted)] = (memory * steps + 1.0, memory * emitted + tokens, memory * total + seconds)
        if self._rest.get(busy, 0) == 0:
            if self._drafts_yield_less(busy):
                self._rest[busy] = self.REST_STEPS
        elif not drafted:
            self._rest[busy] -= 1
            if self._rest[busy] == 0:  # the trial that follows is judged on its own steps
                self._outcomes.pop((busy, True), None)

    def drafts_lose(self, busy: int) -> bool:
        """Is a batch of `busy` resting from drafts, as they yielded less than plain steps (record_outcome)?"""
        return self._rest.get(busy, 0) > 0

    def _drafts_yield_less(self, busy: int) -> bool:
        drafted, plain = self._outcomes.get((busy, True)), self._outcomes.get((busy, False))
        if drafted is None or plain is None or min(drafted[0], plain[0]) < self.OUTCOME_STEPS:
            return False
        return drafted[1] / drafted[2] < plain[1] / plain[2]

    def _first_anchor(self, rows: int, seconds: float, row_hint: float | None) -> np.ndarray:
        """The prior scaled to the first step; with a known fixed part, the rest of that step is the rows' cost; else
        with a prompt row's price, that is what each row costs (a verified row does at least a prompt row's work:
        where rows cost what a step does, as on a CPU backend whose every row multiplies the weights again, no draft
        looks cheap before one was tried)."""
        if self.fixed is not None and 0.0 < self.fixed < seconds:
            return np.array([self.fixed, (seconds - self.fixed) / rows])
        if row_hint is not None and row_hint > 0.0:
            per_row = min(row_hint, seconds / rows)
            return np.array([max(seconds - per_row * rows, 0.01 * seconds), per_row])
        return self._coef * seconds / float(self._coef[0] + self._coef[1] * rows)

    @property
    def coef(self) -> np.ndarray:
        if self._stale:
            # The prior decides only what the data cannot: a and b apart while every step has the same rows.
            n, sx, sxx, sy, sxy = self._sums
            anchor = self._anchor if self._anchor is not None else self._coef  # set by the record() that made it stale
            coef = np.linalg.solve(np.array([[n + 1.0, sx], [sx, sxx + 1.0]]), np.array([sy, sxy]) + anchor)
            self._coef = np.maximum(coef, [anchor[0] * 0.01, 0.0])
            self._stale = False
        return self._coef

    def seconds(self, rows: int) -> float:
        """Estimated seconds of a decode step of `rows` rows (in one-row steps before anything was measured)."""
        a, b = self.coef
        return float(a + b * rows)

    def baseline(self, rows: int) -> float:
        """Seconds of a step of exactly `rows` rows: their own mean once enough such steps ran, else the fit. The
        fit is weighted to be right where drafts take a step (wide batches), and a step's cost bends below that, where
        a fit read too high makes losing drafts look like gains (docs/benchmark-notes.md, "a real draft pair")."""
        steps, total = self._baseline.get(rows, (0.0, 0.0))
        if steps >= self.BASELINE_STEPS:
            return total / steps
        # A size not seen often enough: from the nearest smaller one that was, where that says less than the fit (a
        # four-slot batch whose last two requests run on must not find drafts cheap because the fit is high there).
        known = [r for r, (n, _) in self._baseline.items() if r < rows and n >= self.BASELINE_STEPS]
        fitted = self.seconds(rows)
        if not known:
            return fitted
        below = max(known)
        n, seconds = self._baseline[below]
        return min(fitted, seconds / n + float(self.coef[1]) * (rows - below))

    def with_drafts(self, busy: int, drafts: int) -> float:
        """Seconds of a step of `busy` rows plus `drafts` draft rows: the batch's own cost and what each row adds."""
        return self.baseline(busy) + float(self.coef[1]) * drafts

    @property
    def current(self) -> StepCost:
        """The cost a window sizes drafts by now: this one (DepthCosts answers with the band the engine runs in)."""
        return self

    @property
    def measured(self) -> bool:
        return self._anchor is not None

    @property
    def identified(self) -> bool:
        """Have steps of different sizes been seen, so the per-row cost is measured rather than the prior's guess?
        The data's weight on the slope (weighted count times the variance of the row counts) must outweigh the
        prior's, which grows with the usual row count: a steady batch of 4 pins a + 4b, not b."""
        n, sx, sxx = self._sums[:3]
        if n <= 0:
            return False
        mean = sx / n
        return n * (sxx / n - mean * mean) >= 2.0 * (1.0 + mean * mean)

    @property
    def row_share(self) -> float:
        """What one row adds to a one-row step, as a share of that step (near 1: drafts can hardly pay)."""
        a, b = self.coef
        return float(b / (a + b))

    def describe(self) -> str:
        """The fitted cost, for benchmarks and logs: "4.1 ms + 11.8 ms/row"."""
        a, b = self.coef
        return f"{a * 1e3:.1f} ms + {b * 1e3:.1f} ms/row"


class DepthCosts:
    """StepCost per depth band: a row's attention reads every cell before it, so what a draft row adds grows with the
    context, and a cost learnt on short conversations would make drafts deep in a long one look cheap
    (docs/benchmark-notes.md, "Speculation deep in a long prompt"). A step counts in the band of its deepest row;
    the engine sizes each step's drafts in the band it is about to run in (`at`), which `current` then names. A new
    band takes the fixed part of a step (the weights' share, the same at any depth) from the nearest band that
    measured it, so its first plain step tells what a row costs there, with no trial of drafts that a deep context
    makes dear."""

    FIRST_BAND = 1024  # band 0 holds depths below this; each next band is √2 deeper (an 8K prompt's answer and a
    # 4K one's do not share a band: deep in a context two rows can cost more than twice one)

    def __init__(self) -> None:
        self._bands: dict[int, StepCost] = {}
        self.prompt_row: float | None = None  # seconds of a prompt row, from the latest large chunk
        self.current = self.at(0)

    @classmethod
    def band(cls, depth: int) -> int:
        return 0 if depth < cls.FIRST_BAND else 1 + int(2 * math.log2(depth / cls.FIRST_BAND))

    def at(self, depth: int) -> StepCost:
        """The band of `depth` (a new one the first time), made the current one."""
        self.current = self._band(self.band(depth))
        return self.current

    def learnt_elsewhere(self) -> bool:
        """Is the current band still unmeasured where another band has measured its steps? (Its drafts wait for one
        plain step here.)"""
        return not self.current.measured and any(cost.identified for cost in self._bands.values())

    def record(self, rows: int, outputs: int, seconds: float, *, depth: int) -> None:
        self._band(self.band(depth)).record(rows, outputs, seconds, row_hint=self.prompt_row)

    PROMPT_ROWS = 32  # a prompt chunk of at least this many rows prices a row (its step's fixed part spread thin)

    def observe_prompt(self, rows: int, seconds: float) -> None:
        """A prompt chunk of `rows` rows took `seconds`: the latest large one prices a row for new bands' first
        steps (StepCost.record's row_hint). The latest, as a long prompt's deep chunks price the deep band it opens."""
        if rows >= self.PROMPT_ROWS and seconds > 0:
            self.prompt_row = seconds / rows

    def record_outcome(self, busy: int, *, depth: int, drafted: bool, tokens: int, seconds: float) -> None:
        self._band(self.band(depth)).record_outcome(busy, drafted=drafted, tokens=tokens, seconds=seconds)

    def _band(self, band: int) -> StepCost:
        cost = self._bands.get(band)
        if cost is None:
            known = {b: c for b, c in self._bands.items() if c.identified}
            nearest = min(known, key=lambda b: abs(b - band), default=None)
            cost = self._bands[band] = StepCost(fixed=None if nearest is None else float(known[nearest].coef[0]))
        return cost

    def describe(self) -> str:
        """Each band's fit, for benchmarks and logs: "<1K: 4.1 ms + 11.8 ms/row; 4K-5.66K: ..."."""
        return "; ".join(f"{_band_label(b)}: {cost.describe()}" for b, cost in sorted(self._bands.items()))


def _band_label(band: int) -> str:
    if band == 0:
        return f"<{DepthCosts.FIRST_BAND // 1024}K"
    low, high = (DepthCosts.FIRST_BAND * 2 ** ((band - 1 + k) / 2) for k in (0, 1))
    return f"{low / 1024:.3g}K-{high / 1024:.3g}K"


class DraftWindow:
    """Per request: how often its drafts turn out right, and the rule that sizes each step's draft.

    Draft token i is verified only if the target accepted every one before it, so it adds p_1 * ... * p_i tokens in
    expectation. p_j is the drafter's confidence in token j (n-gram: how long the match is; a model: its probability)
    calibrated by this request's record: acceptance is counted per confidence band, so a drafter that is sure in copy
    runs and unsure at the seams is believed in each. A draft grows while it raises the step's expected tokens per
    second, counting the busy slots' own tokens and the rows each draft token adds: a busy batch makes rows dear,
    and speculation stops by itself. A draft must also promise to beat not drafting by `margin` per busy slot: the
    estimates are noisy, a marginal draft is as likely to cost as to save, and a draft that misses holds up every
    request in the batch."""

    TRIAL = 8  # the longest draft before the per-row cost is measured: one trial must not cost seconds on a CPU
    BANDS = 8  # band i holds confidences in [1 - 2^-i, 1 - 2^-(i+1)): finer near certainty, where runs get long
    MARGIN = 0.05

    @staticmethod
    def any_draft_pays(cost: StepCost, busy_slots: int) -> bool:
        """Could a draft of any window pay in a batch of `busy_slots`? (the module's any_draft_pays)"""
        return any_draft_pays(cost, busy_slots)

    def __init__(
        self,
        limit: int,
        cost: StepCost | DepthCosts,
        *,
        floor: int = 0,
        memory: float = 0.95,
        prior_weight: float = 2.0,
        margin: float = MARGIN,
    ):
        self.limit = limit
        self.floor = min(floor, limit)  # a draft of at least this many tokens is taken whatever it costs
        self._costs = cost
        self.margin = margin
        self.memory = memory
        self.prior_weight = prior_weight
        self._hits = [0.0] * self.BANDS  # decayed counts per band: accepted tokens and verified tokens
        self._trials = [0.0] * self.BANDS
        self.offered: list[float] = []  # confidences of the draft last offered, to credit its band on record()

    @property
    def cost(self) -> StepCost:
        """The cost drafts are sized by: the one given, or the band of the depth the engine runs at now."""
        return self._costs.current

    @classmethod
    def band(cls, confidence: float) -> int:
        return 0 if confidence <= 0.5 else min(cls.BANDS - 1, int(-math.log2(max(1e-9, 1.0 - confidence))))

    @property
    def acceptance(self) -> float:
        """The share of verified draft tokens the target accepted (decayed; 0 before any)."""
        trials = sum(self._trials)
        return sum(self._hits) / trials if trials else 0.0

    def per_token(self, confidence: float) -> float:
        """Probability that a draft token the drafter is `confidence` sure of is right, the drafter's own word
        counting as `prior_weight` trials of its band."""
        b = self.band(confidence)
        return min(
            PER_TOKEN_CEILING, (self._hits[b] + self.prior_weight * confidence) / (self._trials[b] + self.prior_weight)
        )

    def start(self, *, busy_slots: int, draft_seconds: float = 0.0, room: int | None = None) -> DraftRun:
        """Begin sizing one step's draft of at most `room` tokens; `draft_seconds` is what drafting one token costs
        (a draft model's decode)."""
        self.offered = []
        limit = self.limit if room is None else max(0, min(self.limit, room))
        if not self.cost.identified:
            limit = min(limit, max(self.TRIAL, self.floor))
        return DraftRun(self, busy_slots=max(1, busy_slots), draft_seconds=draft_seconds, limit=limit)

    def cut(self, confidences: Sequence[float], *, busy_slots: int) -> int:
        """How many tokens of a ready draft, whose tokens carry `confidences`, to verify."""
        run = self.start(busy_slots=busy_slots, room=len(confidences))
        for confidence in confidences:
            if not run.offer(confidence):
                break
        return run.position if run.worthwhile() else 0

    def record(self, *, drafted: int, accepted: int) -> None:
        """Credit the last draft: its first `accepted` tokens were right, the next (if verified) was wrong."""
        if drafted <= 0:
            return
        self._hits = [h * self.memory for h in self._hits]
        self._trials = [t * self.memory for t in self._trials]
        for i, confidence in enumerate(self.offered[:drafted]):
            b = self.band(confidence)
            self._trials[b] += 1.0
            if i >= accepted:
                break  # later tokens were never really tried: the target diverged here
            self._hits[b] += 1.0


class DraftRun:
    """One step's draft being sized, token by token (see DraftWindow)."""

    def __init__(self, window: DraftWindow, *, busy_slots: int, draft_seconds: float, limit: int):
        self.window = window
        self.limit = limit
        self.position = 0
        self.survival = 1.0
        self._busy = busy_slots
        self._expected = float(busy_slots)  # tokens the step yields: one per busy slot, plus accepted drafts
        self._draft_seconds = draft_seconds if window.cost.measured else 0.0

    def offer(self, confidence: float) -> bool:
        """Take the next draft token if verifying it raises the step's expected tokens per second."""
        if not self.pays(confidence):
            return False
        self.window.offered.append(confidence)
        self.survival *= self.window.per_token(confidence)
        self._expected += self.survival
        self.position += 1
        return True

    def worthwhile(self) -> bool:
        """Does the draft taken so far beat not drafting by the window's margin? (Or reach the request's floor.)"""
        if self.position > 0 and self.window.floor > 0 and self.position >= min(self.window.floor, self.limit):
            return True  # the request's floor is reached (or all the room there was)
        rate = self._expected / self._seconds(self.position)
        return self.position > 0 and rate >= goal_rate(self.window.cost, self._busy, self.window.margin)

    def promising(self) -> bool:
        """Could a draft from this source beat not drafting at all, were every token sure? Asked before the first
        draft token is decoded: a draft model whose tokens cost more than their rows save would otherwise draft a
        whole window every step, each next token paying a little, and throw it away as not worthwhile."""
        return self.window.floor > 0 or any_draft_pays(
            self.window.cost,
            self._busy,
            margin=self.window.margin,
            limit=max(1, self.limit),
            draft_seconds=self._draft_seconds,
        )

    def pays(self, confidence: float = 1.0) -> bool:
        """Would a next token with this confidence pay? (With 1.0: could any next token pay?)"""
        if self.position >= self.limit:
            return False
        if self.position < self.window.floor:
            return True
        if not may_try(self.window.cost, self._busy):
            return False
        gain = self.survival * self.window.per_token(confidence)
        now, longer = self._seconds(self.position), self._seconds(self.position + 1)
        return (self._expected + gain) / longer >= self._expected / now

    def _seconds(self, drafts: int) -> float:
        return self.window.cost.with_drafts(self._busy, drafts) + drafts * self._draft_seconds


PER_TOKEN_CEILING = 0.995  # DraftWindow.per_token never believes a draft token more than this


def may_try(cost: StepCost, busy_slots: int) -> bool:
    """May a batch of `busy_slots` generating requests carry drafts at all? Once the per-row cost is measured, or
    when one request is alone: a trial then costs only the request that gambles on it, never the rest of a shared
    batch (docs/benchmark-notes.md, "Speculation in busy slots")."""
    return busy_slots <= 1 or cost.identified


def goal_rate(cost: StepCost, busy_slots: int, margin: float) -> float:
    """Tokens per second a step with drafts must reach: a step without them, bettered by `margin` per busy slot."""
    return (1.0 + margin * busy_slots) * busy_slots / cost.baseline(busy_slots)


def any_draft_pays(
    cost: StepCost, busy_slots: int, *, margin: float | None = None, limit: int = 64, draft_seconds: float = 0.0
) -> bool:
    """Could any request's draft pay this step? The surest draft there can be (every token at the window's ceiling,
    each costing `draft_seconds` to draft: free by default) of any length up to `limit`, against the window's margin:
    if even that would not beat not drafting, no drafter need be asked (the engine skips them all)."""
    busy = max(1, busy_slots)
    if not may_try(cost, busy):
        return False
    goal = goal_rate(cost, busy, DraftWindow.MARGIN if margin is None else margin)
    expected, survival, best = float(busy), 1.0, 0.0
    for drafts in range(1, limit + 1):
        survival *= PER_TOKEN_CEILING
        expected += survival
        rate = expected / (cost.with_drafts(busy, drafts) + drafts * draft_seconds)
        if rate >= goal:
            return True
        if rate < best:
            return False  # past the peak: a longer draft only adds rows that are less likely to count
        best = rate
    return False


class FixedWindow(DraftWindow):
    """Always drafts `limit` tokens (or the room left), whatever they cost or however sure the drafter is (llama.cpp's
    fixed draft length): a window whose floor is its limit. For tests that need drafts to happen, and benchmarks that
    compare against the adaptive window."""

    def __init__(self, limit: int, cost: StepCost, **options):
        super().__init__(limit, cost, **{**options, "floor": limit})

    @staticmethod
    def any_draft_pays(cost: StepCost, busy_slots: int) -> bool:
        return True
