"""One benchmark line (Figure) and the bracketed measurement of equal work (Bracketed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Figure:
    """One benchmark line: ours against the reference measured in the same run."""

    name: str
    ours: float
    reference: float
    unit: str
    target: float | None  # the ratio ours/reference must reach (or stay under); None: informational
    lower_is_better: bool = False
    note: str = ""
    # For "no slower than" targets where both sides do the same work: how far the reference measured a second time
    # in the same run fell from itself (|1 - again/reference|). A shortfall inside that is not one the run can see.
    noise: float | None = None

    @property
    def ratio(self) -> float:
        return self.ours / self.reference if self.reference else float("nan")

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        slack = self.noise or 0.0
        return self.ratio <= self.target + slack if self.lower_is_better else self.ratio >= self.target - slack

    @property
    def target_text(self) -> str:
        if self.target is None:
            return "—"
        text = f"{'≤' if self.lower_is_better else '≥'} {self.target}"
        return text if self.noise is None else f"{text} within the reference's own spread (±{self.noise:.3f})"

    @property
    def met_text(self) -> str:
        return {None: "—", True: "yes", False: "no"}[self.met]


# Repeats of a Bracketed figure: its median must ride out bursts of host load (docs/benchmark-notes.md).
BRACKET_REPEATS = 9


@dataclass
class Bracketed:
    """A "no slower than the reference" figure where both sides do (nearly) the same work, so a burst of load on a
    shared machine would decide a best-of: each repeat runs the reference, ours, the reference again. The figure is
    the median over repeats, ours against the mean of the two reference runs around it; the two reference runs say
    how far two runs of the same work fall apart here (the figure's noise)."""

    ours: list[float]
    reference: list[float]
    spread: list[float]

    @classmethod
    def measure(cls, reference: Callable[[], float], ours: Callable[[], float], *, repeats: int) -> Bracketed:
        return cls.of([(reference(), ours(), reference()) for _ in range(repeats)])

    @classmethod
    def of(cls, repeats: list[tuple[float, float, float]]) -> Bracketed:
        """From runs already made: each repeat's (reference before, ours, reference after)."""
        run = cls([], [], [])
        for before, mine, after in repeats:
            run.ours.append(mine)
            run.reference.append((before + after) / 2)
            run.spread.append(abs(1 - after / before))
        return run

    def figure(self, name: str, target: float, *, note: str, lower_is_better: bool = False) -> Figure:
        """`lower_is_better`: the runs measured times, not rates, and ours must stay under target x reference."""
        import statistics

        return Figure(
            name,
            statistics.median(self.ours),
            statistics.median(self.reference),
            "tok/s",
            target,
            lower_is_better=lower_is_better,
            noise=statistics.median(self.spread),
            note=f"{note}; median of {len(self.ours)} repeats of reference, ours, reference",
        )
