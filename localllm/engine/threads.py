"""How many CPU threads each step uses: every core the process may use, fewer only while another process holds one.

llama.cpp's threads wait for each other at every operation of a step, so a thread without a core of its own stalls
them all: beside another busy process fewer threads run several times faster (docs/benchmark-notes.md, "Threads
under contention"), while on a free machine the physical cores are what llama.cpp itself uses. So the count starts
there (machine.physical_cores, capped by a cgroup's CPU budget) and moves only on what the OS says over windows of
steps: how much CPU other processes took on this process's CPUs, whether this process's threads got the CPU time
their wall time asked for, and after a pause who is runnable now. The decisions are plain data (ThreadPolicy over
Window values); ThreadTuner is the shell that reads the clocks (a Probe) and feeds it."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

log = logging.getLogger(__name__)

StepKind = Literal["decode", "batch"]  # batch: the step carries a prefill chunk (llama.cpp's n_threads_batch)

# A core counts as taken once other processes use this share of one: a process on a core even part of the time
# stalls every step it meets, and two threads lose to one (docs/benchmark-notes.md, "Threads under contention").
TAKEN = 0.3
# This process's threads waited for a core when their CPU time falls below this share of threads x wall time: with
# llama.cpp's spinning barriers a free machine gives each thread nearly all of the step.
STARVED = 0.75
HOLD = 2  # windows in a row that must agree before the count moves (one can meet a passing burst)
WINDOW_SECONDS = 0.25  # steps' wall time that make a window: a few scheduler ticks on every CPU
PAUSE_SECONDS = 0.1  # an engine idle this long is re-checked before its next step: the load may have changed
STEADY_WINDOWS = 64  # windows a count holds before a move up is trusted at once again (see ThreadPolicy.observe)
# A process whose burst has just ended stays runnable for a millisecond or a few (llama-server's threads spin, then
# park): a run queue that would lower the count after a pause is read again this often, this many times, and its
# least reading counts; each re-read past the burst's end delays the first step (docs/benchmark-notes.md, "the run
# queue right after a burst").
RECHECK_SECONDS = 0.0005
RECHECKS = 20
# A first token waits in the server's stream and event loop threads, and the client's, for a core: the next step's
# threads hold every one for a scheduler slice or more, so that step starts this much later (docs/benchmark-notes.md,
# "the first token's hand-over").
HANDOFF_SECONDS = 0.002


@dataclass(frozen=True)
class Window:
    """What the OS said over a stretch of this engine's steps, or over a pause between them (threads 0).

    wall: the steps' seconds (a pause: its length); cpu: this process's CPU seconds over them; elsewhere: cores'
    worth of CPU other processes used on this process's CPUs over the window, None where the OS does not say;
    runnable: after a pause, how many other tasks are runnable at its end (the run queue now), None otherwise."""

    threads: int
    wall: float
    cpu: float
    elsewhere: float | None = None
    runnable: int | None = None


class ThreadPolicy:
    """The count to run at, from Window values alone: `observe(window, fresh=...)` returns it.

    `full` is where it starts and what it returns to: llama.cpp's own default (machine.physical_cores). A window
    points to a count (`target`): the CPUs less the cores other processes took, or, where the OS does not say, one
    fewer than ran when this process's threads were starved of CPU time. The count moves when HOLD windows in a row
    point the same way, to the nearest of their counts. A pause's window moves it alone: it joins the average over
    the pause with who is runnable now, so a burst that has passed holds nothing down and a load still running is
    met before the first step. A fresh window (a prefill chunk, seconds long, about to run below full) moves it up
    alone: it must not run on a count chosen for a busy moment that has passed. A move up taken back at once
    (starved windows can only tell the load has ended by trying) makes the next one wait twice as many windows."""

    def __init__(self, full: int, cpus: int | None = None):
        self.full = max(1, full)
        self.cpus = max(self.full, cpus or self.full)
        self.count = self.full
        self.moves = 0
        self._ups: list[int] = []  # targets of the windows in a row that point above the count
        self._downs: list[int] = []  # and below it
        self._up_after = HOLD  # windows pointing up before the count moves up
        self._held = 0  # windows since the count last moved
        self._rose = False  # the last move was up

    def target(self, window: Window) -> int:
        """The count this window alone points to."""
        free = self.cpus
        if window.elsewhere is not None:
            # A pause's own CPU time is this process's other work (another model's engine): it holds cores too.
            busy = window.elsewhere + (window.cpu / window.wall if window.threads == 0 and window.wall > 0 else 0.0)
            taken = _cores_taken(busy)
            if window.runnable is not None:  # the average over a pause counts only what still runs now
                taken = min(taken, window.runnable)
            free -= taken
        target = min(self.full, free)
        # Where the OS gives no account of other processes, this process's threads short of CPU time say it: they
        # waited for cores something else held. Where it does, its account decides (what it leaves out is this
        # process's own work, which fewer threads here would not free).
        if window.elsewhere is None and window.threads > 1 and window.cpu < STARVED * window.threads * window.wall:
            target = min(target, window.threads - 1)
        return max(1, target)

    def observe(self, window: Window, *, fresh: bool = False) -> int:
        target = self.target(window)
        self._held += 1
        if self._held >= STEADY_WINDOWS:
            self._up_after = HOLD
        pause = window.threads == 0 and window.runnable is not None
        if target > self.count:
            self._ups.append(target)
            self._downs = []
            if len(self._ups) >= self._up_after or ((fresh or pause) and self._up_after == HOLD):
                self._move(min(self._ups))
        elif target < self.count:
            self._downs.append(target)
            self._ups = []
            if len(self._downs) >= HOLD or pause:
                if self._rose and self._held <= HOLD + 1:  # the move up is taken back at once: it was wrong
                    self._up_after = min(STEADY_WINDOWS, self._up_after * 2)
                self._move(max(self._downs))
        else:
            self._ups, self._downs = [], []
        return self.count

    def reset(self) -> None:
        """Forget the windows seen: the load on the machine changed in a way the engine knows of."""
        self._ups, self._downs = [], []
        self._up_after = HOLD

    def _move(self, count: int) -> None:
        self._rose = count > self.count
        self.count, self.moves, self._held = count, self.moves + 1, 0
        self._ups, self._downs = [], []


def _cores_taken(busy: float) -> int:
    """Cores that `busy` cores' worth of other processes' CPU holds, a core counting from TAKEN of one."""
    return int(busy + 1 - TAKEN) if busy >= TAKEN else 0


class Probe(Protocol):
    """Where the tuner reads the clocks: wall and process CPU seconds, and the OS's account of its CPUs."""

    def now(self) -> float: ...

    def process_cpu(self) -> float: ...

    def busy(self) -> float | None:
        """CPU seconds all processes have used on this process's CPUs (since boot); None where the OS does not say."""
        ...

    def runnable(self) -> int | None:
        """Tasks runnable on the machine now, the calling thread included; None where the OS does not say."""
        ...

    def cpus(self) -> int: ...

    def wait(self, seconds: float) -> None:
        """Let `seconds` pass (the run queue is read again after it)."""
        ...


class LinuxProbe:
    """/proc/stat's CPU lines (only this process's CPUs) and /proc/loadavg's run queue; elsewhere the clocks only."""

    def __init__(self, root: Path = Path("/proc")):
        self._stat, self._loadavg = root / "stat", root / "loadavg"
        try:
            self._allowed = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self._allowed = set()
        self._tick = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def now(self) -> float:
        return time.perf_counter()

    def process_cpu(self) -> float:
        return time.process_time()

    def busy(self) -> float | None:
        try:
            lines = self._stat.read_text().splitlines()
        except OSError:
            return None
        ticks = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in self._allowed:
                # user nice system idle iowait irq softirq steal: all but idle and iowait held the CPU (steal too:
                # a virtual machine's host ran something else on it)
                fields = [int(f) for f in rest.split()[:8]]
                ticks += sum(fields) - fields[3] - fields[4]
        return ticks * self._tick if self._allowed else None

    def runnable(self) -> int | None:
        try:
            return int(self._loadavg.read_text().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            return None

    def cpus(self) -> int:
        return len(self._allowed) or os.cpu_count() or 1

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)


class ThreadTuner:
    """The engine's side: `choose(kind)` before a step, `record(kind, threads, rows, seconds)` after it.

    Steps add up into a Window until WINDOW_SECONDS of their wall time. Before the first step after a pause of
    PAUSE_SECONDS or more, everything since the last window is one window of its own, with the run queue now; before
    a prefill chunk while the count is below full, the window under way ends early and may raise the count."""

    def __init__(self, max_threads: int, *, probe: Probe | None = None):
        self.probe: Probe = probe or LinuxProbe()
        self.policy = ThreadPolicy(max_threads, self.probe.cpus())
        self._wall = self._cpu = 0.0  # the window's steps so far
        self._cpu_at_step = 0.0
        self._last_end: float | None = None  # when the last step ended, or a pause was last read
        self._start = self._mark()  # (wall, process CPU, OS busy) where the window began
        self._changed = False

    def resume(self) -> None:
        """The engine has work after a pause: read the machine now, before the engine tells its new requests they
        are in. That news wakes the server's threads that carry it (a stream's pump, the event loop), and a run queue
        read while they run would count them as another process's load and hold the first step for re-reads."""
        if self._paused():
            self._observe_pause()

    def choose(self, kind: StepKind) -> int:
        if self._changed or self._paused():
            self._observe_pause()
        elif kind == "batch" and self.policy.count < self.policy.full and self._wall > 0:
            self._close_window(fresh=True)
        self._cpu_at_step = self.probe.process_cpu()
        return self.policy.count

    def record(self, kind: StepKind, threads: int, rows: int, seconds: float) -> None:
        self._wall += seconds
        self._cpu += self.probe.process_cpu() - self._cpu_at_step
        self._last_end = self.probe.now()
        if self._wall >= WINDOW_SECONDS:
            self._close_window()

    def retry(self) -> None:
        """The load on the machine changed in a way the engine knows of (work of its own in another process, such
        as the flash attention trial, ended): the next step reads the machine afresh, as after a pause."""
        self.policy.reset()
        self._changed = True

    def hand_over(self) -> None:
        """A request's first token has just gone to its reader: where this engine's threads take every CPU the
        process may use, let the threads carrying it to the client run before the next step takes them all."""
        if self.policy.count >= self.probe.cpus():
            self.probe.wait(HANDOFF_SECONDS)

    def settled(self, kind: StepKind) -> int:
        """The count the next step of `kind` runs at."""
        return self.policy.count

    def _close_window(self, *, fresh: bool = False) -> None:
        start, end = self._start, self._mark()
        self._observe(Window(self.policy.count, self._wall, self._cpu, _elsewhere(start, end)), fresh=fresh)
        self._begin(end)

    def _paused(self) -> bool:
        return self._last_end is not None and self.probe.now() - self._last_end >= PAUSE_SECONDS

    def _observe_pause(self) -> None:
        """One window from the last one's end to now: the steps in it count as this engine's, the rest of this
        process's CPU time as its other work."""
        start, end = self._start, self._mark()
        window = Window(
            threads=0,
            wall=end[0] - start[0] - self._wall,
            cpu=max(0.0, end[1] - start[1] - self._cpu),
            elsewhere=_elsewhere(start, end),
            runnable=self._others_runnable(),
        )
        if window.wall > 0:
            if self.policy.target(window) < self.policy.count:
                window = replace(window, runnable=self._least_runnable(window.runnable))
            self._observe(window, fresh=True)
        self._changed = False
        self._last_end = end[0]
        self._begin(end)

    def _observe(self, window: Window, *, fresh: bool) -> None:
        before = self.policy.count
        if self.policy.observe(window, fresh=fresh) != before:
            log.debug("threads %d -> %d after %s", before, self.policy.count, window)

    def _least_runnable(self, first: int | None) -> int | None:
        """The run queue's least reading over RECHECKS more, stopping at an empty one: a burst that just ended
        leaves it empty within milliseconds, a load that still runs keeps it full."""
        least = first
        for _ in range(RECHECKS):
            if not least:
                break
            self.probe.wait(RECHECK_SECONDS)
            runnable = self._others_runnable()
            if runnable is None:
                break
            least = min(least, runnable)
        return least

    def _others_runnable(self) -> int | None:
        """The run queue less the engine thread asking; None where the OS does not say."""
        runnable = self.probe.runnable()
        return None if runnable is None else max(0, runnable - 1)

    def _begin(self, mark: tuple[float, float, float | None]) -> None:
        self._wall = self._cpu = 0.0
        self._start = mark

    def _mark(self) -> tuple[float, float, float | None]:
        return self.probe.now(), self.probe.process_cpu(), self.probe.busy()


def _elsewhere(start: tuple[float, float, float | None], end: tuple[float, float, float | None]) -> float | None:
    """Cores' worth of CPU that other processes used between two marks."""
    wall = end[0] - start[0]
    if start[2] is None or end[2] is None or wall <= 0:
        return None
    return max(0.0, (end[2] - start[2]) - (end[1] - start[1])) / wall
