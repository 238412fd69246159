"""How many CPU threads each decode uses, chosen while the model runs instead of fixed at load.

llama.cpp's speed against its thread count depends on the machine and on what else runs there: once another process
takes a core, threads that wait for it stall every step, and fewer threads run faster (docs/benchmark-notes.md). So
the engine measures: per kind of step (decode-only, or carrying a prefill chunk), it tries each count from 1 to the
physical cores in turn (the one in use first), keeps the fastest, and tries them again now and then, and at once when
decode steps slow down (prefill follows their verdict: its cost depends on the prompt's depth more than on the
machine). Pure bookkeeping on (threads, rows, seconds): the engine thread times each decode and sets the count."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

StepKind = Literal["decode", "batch"]  # batch: the step carries a prefill chunk (llama.cpp's n_threads_batch)


@dataclass
class _Tuning:
    """One kind of step: the counts under trial, or the settled count and how its steps compare with when it won."""

    candidates: list[int]
    shape: TrialShape
    trials: list[tuple[int, bool]] = field(default_factory=list)  # (count, measured) still to run, in order
    trying: list[int] = field(default_factory=list)  # the counts the trial under way runs, each round
    samples: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # per count: (rows bucket, s/row)
    best: int = 0
    # The settled count's seconds per row, per rows bucket: from its trial, or its first steps of a new batch shape.
    baselines: dict[int, list[float]] = field(default_factory=dict)
    recent: deque[float] = field(default_factory=deque)  # the settled count's latest steps, as a share of baseline
    recent_steps: deque[tuple[int, float]] = field(default_factory=deque)  # the same steps: (rows bucket, s/row)
    since: int = 0  # steps since it settled
    interval: int = 0  # steps before the next re-check: short after a change of count, doubling while it holds
    settles: int = 0  # how many times it has settled (for ps and the benchmark)
    slowed: bool = False  # the trial under way began because the settled count's steps slowed down
    last_trial_steps: int = 0  # steps the last trial took, from its start to settling


class ThreadTuner:
    """Chooses each step's thread count. `choose(kind)` before a decode, `record(kind, threads, rows, seconds)` after.

    Trials interleave the candidates, the count in use first (n, 1, .., n-1, n, 1, ...), for up to `rounds` rounds, each
    count for its kind's TrialShape, so a change in the batch or the machine during a trial weighs on every count alike;
    each count's mean seconds per row decides, and more threads win only by `margin`. A trial ends after two rounds when
    one count's slowest step beat every other count's fastest, after one when a first trial finds the default FAR ahead,
    and at the first measured step that shows a re-check's settled count standing apart again: a trial's steps at the
    losing counts are what tuning costs. A settled count is tried again soon (`first_recheck` steps), then less often
    while trials keep choosing it (up to `recheck` steps): a trial may have met a passing load, such as another
    program's threads winding down. A watched kind (decode) is tried at once when its last `patience` steps took on
    average (less the slowest) more than `slowdown` times its baseline (another process took a core): then those steps
    are its samples, only the other counts run, and one round may settle it; when it moves to another count, the kinds
    not watched (prefill) try theirs again too.

    Means, not medians: while another process shares the cores, threads that need a core of their own run some steps
    fast (the other process is off the CPU) and others several times slower; a median of such steps looks fast, and
    a count chosen by it, or a slowdown looked for in a run of slow steps, can keep half the speed the fewer threads
    give (docs/benchmark-notes.md, "Threads under contention")."""

    def __init__(
        self,
        max_threads: int,
        *,
        rounds: int = 3,
        first_recheck: int = 64,
        recheck: int = 1024,
        slowdown: float = 1.3,
        patience: int = 6,
        margin: float = 1.05,
    ):
        self.candidates = list(range(1, max(1, max_threads) + 1))
        self.rounds = rounds
        self.first_recheck = first_recheck
        self.recheck = recheck
        self.slowdown = slowdown
        self.patience = patience
        self.margin = margin
        self._kinds: dict[str, _Tuning] = {}

    def choose(self, kind: StepKind) -> int:
        tuning = self._tuning(kind)
        return tuning.trials[0][0] if tuning.trials else tuning.best

    def record(self, kind: StepKind, threads: int, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        tuning = self._tuning(kind)
        shape, per_row = _bucket(rows), seconds / rows
        if tuning.trials:
            planned, measured = tuning.trials[0]
            if threads == planned:
                if measured:
                    tuning.samples.setdefault(threads, []).append((shape, per_row))
                tuning.trials.pop(0)
                tuning.last_trial_steps += 1
                rounds, within = divmod(tuning.last_trial_steps, len(tuning.trying) * tuning.shape.steps)
                if (within == 0 and self._clear_early(tuning, rounds)) or (measured and _confirmed(tuning)):
                    tuning.trials = []
                if not tuning.trials:
                    moved = self._settle(tuning)
                    if moved and tuning.shape.watched:
                        self._follow()
            return
        tuning.since += 1
        seen = tuning.baselines.setdefault(shape, [])
        if len(seen) < BASELINE_STEPS:  # a batch shape the trial did not see: its first steps set its baseline
            seen.append(per_row)
            return
        tuning.recent.append(per_row / statistics.median(seen))
        tuning.recent_steps.append((shape, per_row))
        if len(tuning.recent) > self.patience:
            tuning.recent.popleft()
            tuning.recent_steps.popleft()
        slowed = (
            tuning.shape.watched and len(tuning.recent) == self.patience and _typical(tuning.recent) > self.slowdown
        )
        if slowed or tuning.since >= tuning.interval:
            self._start_trial(tuning, slowed=slowed)

    def retry(self) -> None:
        """Try the counts again at the next step of every kind already settled: the load on the machine changed in
        a way the engine knows of (work of its own in another process, such as the flash attention trial, ended),
        which a count settled while it ran would otherwise keep until its next re-check."""
        self._try_again(self._kinds.values())

    def _follow(self) -> None:
        """A watched kind moved to another count: the load on the machine changed, so the kinds that are not watched
        (their own steps cannot tell) try their counts again at their next step."""
        self._try_again(tuning for tuning in self._kinds.values() if not tuning.shape.watched)

    def _try_again(self, kinds: Iterable[_Tuning]) -> None:
        for tuning in kinds:
            if not tuning.trials:
                self._start_trial(tuning)

    def settled(self, kind: StepKind) -> int | None:
        """The count in use for `kind` once a trial has settled it; None while the first trial runs."""
        tuning = self._kinds.get(kind)
        return tuning.best if tuning is not None and tuning.settles else None

    def trial_steps(self, kind: StepKind) -> int:
        """Steps the last finished trial of `kind` took (what settling costs after the load changes)."""
        tuning = self._kinds.get(kind)
        return tuning.last_trial_steps if tuning is not None else 0

    def _tuning(self, kind: StepKind) -> _Tuning:
        tuning = self._kinds.get(kind)
        if tuning is None:
            tuning = self._kinds[kind] = _Tuning(self.candidates, TRIAL_SHAPES[kind], best=self.candidates[-1])
            self._start_trial(tuning)
        return tuning

    def _start_trial(self, tuning: _Tuning, *, slowed: bool = False) -> None:
        if len(tuning.candidates) == 1:  # nothing to choose, and nothing to watch
            tuning.best, tuning.since, tuning.settles = tuning.candidates[0], 0, 1
            tuning.interval = self.recheck
            tuning.baselines, tuning.recent, tuning.recent_steps = {}, deque(), deque()
            return
        # After a slowdown the settled count's latest steps are its samples, and only the other counts run: a step
        # more at the slowed count is what a user waits for.
        # The count in use runs first: a trial that finds it again switches nothing, and a first trial may end after
        # its first round (_clear_early) with the default never having left it.
        ordered = sorted(tuning.candidates, key=lambda t: t != tuning.best)
        tuning.trying = [t for t in ordered if t != tuning.best] if slowed else ordered
        tuning.samples = {tuning.best: list(tuning.recent_steps)} if slowed else {}
        block = [False] * tuning.shape.warm_up + [True] * tuning.shape.measured
        tuning.trials = [(t, measured) for _ in range(self.rounds) for t in tuning.trying for measured in block]
        tuning.last_trial_steps = 0
        tuning.slowed = slowed

    @staticmethod
    def _clear_early(tuning: _Tuning, rounds: int) -> bool:
        """Whether a trial may end after `rounds` rounds: one count stands apart after two, or after one when the
        settled count's slowdown began it, or when a first trial finds the default (every core) ahead by FAR (a first
        trial's two rounds guard against a passing load making fewer threads look faster; ending early on the default
        keeps what the engine would run untuned, and after a slowdown the load has changed). A prefill chunk at a count
        that loses by that much costs seconds."""
        winner = _standing_apart(tuning.samples)
        if winner is None:
            return False
        if rounds >= 2 or (tuning.settles > 0 and tuning.slowed):  # a re-check finding its count: _confirmed
            return True
        return tuning.settles == 0 and winner == tuning.best and _standing_apart(tuning.samples, by=FAR) == winner

    def _settle(self, tuning: _Tuning) -> bool:
        """Settle on the fastest count; True when that is a change from the count settled before."""
        means = {t: statistics.fmean(per_row for _, per_row in s) for t, s in tuning.samples.items() if s}
        # Fewer threads unless more are faster by the margin: they leave more of the machine to everything else,
        # and more threads lose most when a core is taken.
        fastest = min(means.values())
        best = min(t for t in means if means[t] <= fastest * self.margin)
        confirmed = tuning.settles > 0 and best == tuning.best
        moved = tuning.settles > 0 and best != tuning.best
        tuning.interval = min(self.recheck, tuning.interval * 2) if confirmed else self.first_recheck
        tuning.best = best
        tuning.baselines = {}
        for shape, per_row in tuning.samples[tuning.best]:
            tuning.baselines.setdefault(shape, []).append(per_row)
        tuning.since, tuning.recent, tuning.recent_steps = 0, deque(), deque()
        tuning.settles += 1
        return moved


@dataclass(frozen=True)
class TrialShape:
    """A count's steps in each round of a trial: unmeasured ones first, then the measured ones; `watched`: the
    kind's own steps are watched for a slowdown."""

    warm_up: int
    measured: int
    watched: bool

    @property
    def steps(self) -> int:
        return self.warm_up + self.measured


TRIAL_SHAPES: dict[str, TrialShape] = {
    # The first decode after a change of count pays for starting the threads (llama.cpp's OpenMP team), which would
    # count against more threads; a decode is short, so that start is a large share of it.
    "decode": TrialShape(warm_up=1, measured=2, watched=True),
    # A prefill chunk is long beside that start, and rare (one per turn of a chat): every one of them counts. Its
    # steps are not watched: a chunk deeper in a prompt costs more a row, so they would start trials that each run
    # seconds of prefill at the wrong count. A slowdown seen in decode steps, which follow the machine alone, starts
    # theirs.
    "batch": TrialShape(warm_up=0, measured=1, watched=False),
}
# How far ahead the default must stand to end a first trial after one round: between what one thread of two loses
# on prefill chunks and on decode steps, so decode trials keep two rounds (docs/benchmark-notes.md, "FAR").
FAR = 1.3
BASELINE_STEPS = 3  # steps of a batch shape that set the settled count's baseline for it


def _typical(values: Iterable[float]) -> float:
    """The mean of `values` less the single slowest one (of three or more). A lone step that met a passing hiccup (a
    garbage collection of the process, a page fault, a virtual machine's host) must not start a trial, while a load
    that slows a share of the steps still weighs in full. A trial's means keep every step: a hiccup there costs one
    re-check, and a trimmed mean would favour more threads under a load that slices them."""
    ordered = sorted(values)
    return statistics.fmean(ordered[:-1] if len(ordered) >= 3 else ordered)


def _confirmed(tuning: _Tuning) -> bool:
    """A re-check may end at any measured step once every count has run and the settled count stands apart: each
    further step at a losing count is what the re-check costs, and under load one costs many. Leaving the settled
    count still waits for whole rounds."""
    tried = all(tuning.samples.get(t) for t in tuning.trying)
    return tuning.settles > 0 and tried and _standing_apart(tuning.samples) == tuning.best


def _standing_apart(samples: dict[int, list[tuple[int, float]]], *, by: float = 1.0) -> int | None:
    """The count whose slowest step beat every other count's fastest (`by` times over); None when no count stands
    apart."""
    if len(samples) < 2:
        return None
    slowest = {t: max(per_row for _, per_row in s) for t, s in samples.items()}
    fastest = {t: min(per_row for _, per_row in s) for t, s in samples.items()}
    best = min(slowest, key=slowest.__getitem__)
    return best if all(slowest[best] * by < fastest[t] for t in samples if t != best) else None


def _bucket(rows: int) -> int:
    """Steps compare with steps of about the same rows: exact up to 8 rows, then by powers of two."""
    return rows if rows <= 8 else 1 << (rows - 1).bit_length()
