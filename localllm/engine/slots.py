"""Slots: the only holder of per-sequence cache facts. A slot is one sequence id in the backend's context; it
remembers which tokens its KV cache holds so the next request with the same prefix skips them.

A slot holds sequence facts only; everything about the request it serves (sampler, stop strings, statistics) lives
in the request (scheduler.Request)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

R = TypeVar("R")  # the request a slot serves (scheduler.Request)


class SlotState(Enum):
    IDLE = "idle"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Slot(Generic[R]):
    seq: int
    state: SlotState = SlotState.IDLE
    cached: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds, in position order
    request: R | None = None  # the request being served
    last_used: int = 0  # step counter, to prefer evicting the coldest cache
    # The shortest prefix this cache can be cut to and continued (0: any). Above 0 after restoring a state that holds
    # only the last window of sliding-window layers (backends.base.CacheShape.saved_floor).
    floor: int = 0

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class SlotChoice(Generic[R]):
    """Where a new request goes: `slot`, reusing `reuse` of its own cached tokens, or first copying the prefix of
    `copy_from` (another slot's sequence) when that shares more."""

    slot: Slot[R]
    reuse: int
    copy_from: Slot[R] | None = None


def usable_prefix(shared: int, held: int, floor: int, *, recurrent: bool = False) -> int:
    """How many of `held` cached tokens a request sharing `shared` of them can keep: all it shares, unless that cut
    falls below the cache's floor (or, for a recurrent state, anywhere but its end); then none."""
    lowest = held if recurrent else floor
    return shared if shared >= lowest else 0


class SlotTable(Generic[R]):
    def __init__(self, n_slots: int, *, recurrent: bool = False):
        self.slots: list[Slot[R]] = [Slot(seq=i) for i in range(n_slots)]
        self.recurrent = recurrent  # recurrent states (Mamba, hybrids) continue only from their end

    def usable(self, slot: Slot[R], prompt: Sequence[int], *, keep_last: bool = True) -> int:
        """How much of `slot`'s cache a request for `prompt` can reuse. keep_last: at least the prompt's last token is
        decoded again, since its output is the first generated token."""
        shared = common_prefix(slot.cached, prompt)
        if keep_last:
            shared = min(shared, len(prompt) - 1)
        return usable_prefix(shared, len(slot.cached), slot.floor, recurrent=self.recurrent)

    def free(self) -> list[Slot[R]]:
        return [s for s in self.slots if not s.busy]

    def busy(self) -> list[Slot[R]]:
        return [s for s in self.slots if s.busy]

    def serving(self) -> list[tuple[Slot[R], R]]:
        """Each busy slot with the request it serves."""
        return [(s, s.request) for s in self.slots if s.busy and s.request is not None]

    def choose(self, prompt: Sequence[int]) -> SlotChoice[R] | None:
        """The free slot whose cache shares the longest prefix with `prompt` (ties: the least recently used), and
        a donor slot when another one, busy or not, holds a longer shared prefix (a common system prompt)."""
        free = self.free()
        if not free:
            return None
        scored = [(self.usable(s, prompt), -s.last_used, s) for s in free]
        own, _, slot = max(scored, key=lambda t: (t[0], t[1]))
        if own == 0:
            # Nothing to reuse: take the coldest free cache, so warm prefixes survive for later requests.
            slot = min(free, key=lambda s: (len(s.cached) > 0, s.last_used))
        donor, shared = self._best_donor(prompt, exclude=slot)
        if donor is not None and shared > own:
            return SlotChoice(slot=slot, reuse=shared, copy_from=donor)
        return SlotChoice(slot=slot, reuse=own)

    def _best_donor(self, prompt: Sequence[int], *, exclude: Slot[R]) -> tuple[Slot[R] | None, int]:
        best, best_len = None, 0
        for s in self.slots:
            if s is exclude:
                continue
            n = self.usable(s, prompt)
            if n > best_len:
                best, best_len = s, n
        return best, best_len
