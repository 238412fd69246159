"""The scheduler: pure bookkeeping over slots and a bounded queue. It never calls a backend.

    admit(request)          queue a request (QueueFull when the queue is full)
    schedule() -> Step      the next batch: one decode row (plus drafts) per generating slot, and prefill chunks
                            of admitted requests in the rest of the step budget (chunked prefill sized by time,
                            engine/step_budget.py: a long prompt never stalls the others)
    update(step, sampled)   record what the backend decoded and what was sampled; returns newly accepted tokens
    finish(request, why)    free its slot; its cache stays behind for prefix reuse
    cancel(request)         finish at the next schedule()
    restored(request, ok)   the engine restored (or failed to restore) the saved prefix a step asked for

With a KV pool (`kv_cells` below the slots' n_slots x n_ctx: llama.cpp's unified cache) the slots draw their cells
from one pool, so one long conversation can use what short ones leave. The scheduler bounds the cells held across
the slots by the pool: a request takes a slot only when its prompt fits (idle slots' caches are given up for it,
saved to the prefix cache first), prefills always fit their reservation, and a decoder that finds the pool full
ends with "length", as at the end of its context. No step ever asks the backend for more cells than it has.

With a prefix cache (engine/prefix_cache.py), a step also says which slots to save before they lose their prefix and
which saved prefix to restore into a slot; the scheduler reads the cache's index, the engine moves the bytes.

The engine thread runs schedule → backend.decode → sample → update in a loop (engine/runner.py)."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..backends.base import Batch, Sampler
from ..errors import QueueFull
from ..media import PromptImage, is_placeholder
from .prefix_cache import SAVE_MIN_TOKENS, Entry, Match, PrefixCache
from .slots import Slot, SlotChoice, SlotState, SlotTable
from .speculative.drafters import Drafter
from .step_budget import Pacing

_ids = itertools.count(1)
log = logging.getLogger(__name__)


SinkT = TypeVar("SinkT")


@dataclass(eq=False)
class Request(Generic[SinkT]):
    """One generation: its prompt, limits and progress. `sampler`, `drafter` and `sink` (where its output goes) are
    the engine's objects; the scheduler only carries them."""

    prompt: list[int]
    max_tokens: float  # math.inf: until the context is full
    sink: SinkT
    sampler: Sampler | None = None
    drafter: Drafter | None = None
    id: int = field(default_factory=lambda: next(_ids))
    slot: Slot[Request[Any]] | None = None
    generated: list[int] = field(default_factory=list)
    n_cached: int = 0  # prompt tokens reused from the cache
    n_prefilled: int = 0  # prompt tokens now in the slot's KV (cached ones included)
    cancelled: bool = False
    done_reason: str | None = None
    draft: list[int] = field(default_factory=list)  # draft tokens in the current step
    n_drafted: int = 0
    n_accepted: int = 0
    n_draft_steps: int = 0  # steps whose decode row carried drafts
    follows: Request | None = None  # a request with the same prompt whose prefill this one waits for and copies
    keep_prefix: bool = False  # when it ends, save its slot as a pinned prefix (the API's keep_prefix)
    cache_tier: str | None = None  # where its reused prefix came from: "slot", "ram" or "disk"
    restoring: bool = False  # waiting for the engine to restore a saved prefix into its slot
    unconfirmed: Entry | None = None  # the saved prefix restored into its slot, until a decode continues from it
    # Deterministic mode: it runs alone (no other request's rows in its batches) and prefills its whole prompt from
    # position 0 in the same chunks, so nothing cached or running beside it changes its numerics.
    deterministic: bool = False
    images: tuple[PromptImage, ...] = ()  # the images whose placeholders the prompt holds (the engine encodes them)

    @property
    def finished(self) -> bool:
        return self.done_reason is not None


@dataclass
class SlotWork:
    """The rows of one request in a step. `rows[i]` is the batch row whose output predicts the token after
    `tokens[i]`; rows holds only the rows to sample (the last prefill row, or the decode row and its drafts)."""

    request: Request[Any]
    rows: list[int]
    draft: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Save:
    """Save sequence `seq`'s state, which holds `tokens`, into the prefix cache (before the slot loses them)."""

    seq: int
    tokens: tuple[int, ...]
    pinned: bool = False


@dataclass(frozen=True)
class Restore:
    """Load `entry`'s state into `seq` and keep its first `keep` tokens, for `request`."""

    seq: int
    entry: Entry
    keep: int
    request: Request[Any]


@dataclass
class Step:
    batch: Batch = field(default_factory=Batch)
    work: list[SlotWork] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)  # done first: before restores, trims and copies
    restores: list[Restore] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src_seq, dst_seq, n_tokens)
    trims: list[tuple[int, int]] = field(default_factory=list)  # (seq, keep_first_n)
    finished: list[Request[Any]] = field(default_factory=list)  # cancelled or over-long requests to report

    def __bool__(self) -> bool:
        return bool(self.batch.tokens or self.finished)

    @property
    def cache_ops(self) -> bool:
        return bool(self.saves or self.restores or self.trims or self.copies)

    @property
    def donors(self) -> set[int]:
        """Sequences this step copies from: their caches must stay whole until the copies (which run last)."""
        return {src for src, _, _ in self.copies}


def _text_end(prompt: list[int], start: int) -> int:
    """Where the run of text tokens from `start` ends: at the next image placeholder, or the prompt's end."""
    return next((i for i in range(start, len(prompt)) if is_placeholder(prompt[i])), len(prompt))


def _text_start(prompt: list[int], start: int) -> int:
    """Where the run of image placeholders from `start` ends."""
    return next((i for i in range(start, len(prompt)) if not is_placeholder(prompt[i])), len(prompt))


def restore_cells(prompt_len: int, saved: Match) -> int:
    """Cells a request takes that restores `saved`: a restore loads the whole saved state before cutting it to what
    the prompt shares, and the prompt's rest and its first token follow."""
    return prompt_len - saved.reuse + 1 + saved.entry.n_tokens - saved.reuse


def _prefilling(request: Request | None) -> bool:
    """Whether `request` still has prompt to prefill (waiting for a slot, or in its prefill)."""
    if request is None or request.finished:
        return False
    return request.slot is None or request.slot.state is SlotState.PREFILL


class Scheduler:
    def __init__(
        self,
        *,
        n_slots: int,
        n_ctx: int,
        n_batch: int,
        max_queue: int,
        kv_pad: int = 1,
        prefix_cache: PrefixCache | None = None,
        pacing: Pacing | None = None,
        kv_cells: int | None = None,
    ):
        if kv_cells is not None and kv_cells < n_ctx:
            raise ValueError(f"a KV pool of {kv_cells} cells cannot hold one slot's context of {n_ctx}")
        recurrent = prefix_cache is not None and prefix_cache.shape.recurrent
        self.table: SlotTable[Request[Any]] = SlotTable(n_slots, recurrent=recurrent)
        self.cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self._pinned_saves: list[Save] = []  # finished keep_prefix requests, saved at the next step
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.kv_pad = kv_pad  # the backend attends over its KV cache in spans of this many cells (see _chunk_end)
        self.max_queue = max_queue
        self.waiting: deque[Request[Any]] = deque()
        self._steps = 0
        self.pacing = pacing  # None: every step takes num_batch tokens
        # Cells the slots share; None where each slot has n_ctx of its own (no sum to bound).
        self.kv_cells = kv_cells if kv_cells is not None and kv_cells < n_slots * n_ctx else None
        self._cells_used = 0  # batch rows added in the step being built: each takes a cell
        self._offered: dict[int, int] = {}  # seq -> the slot's last_used when its idle cache was last saved ahead
        self._held_back: set[int] = set()  # seqs of idle caches a starting request left for after its first token

    # ----------------------------------------------------------------------------------------------- intake

    def admit(self, request: Request[Any]) -> None:
        # Waiting requests take the free slots at the next schedule(); only the rest count against the queue.
        if len(self.waiting) >= self.max_queue + len(self.table.free()):
            raise QueueFull(
                f"{len(self.waiting)} requests are already waiting for a slot",
                hint="retry shortly, or raise LOCALLLM_MAX_QUEUE / LOCALLLM_NUM_PARALLEL",
            )
        self.waiting.append(request)

    def cancel(self, request: Request[Any]) -> None:
        request.cancelled = True

    @property
    def idle(self) -> bool:
        """Nothing to do until a request comes: none waits or runs, and no idle cache is due a save ahead."""
        return not self.waiting and not self.table.busy() and self._next_to_save_ahead() is None

    def decoding(self) -> list[Request[Any]]:
        """Requests past their prompt, generating one token (plus drafts) per step."""
        return [req for slot, req in self.table.serving() if slot.state is SlotState.DECODE]

    @property
    def running(self) -> list[Request[Any]]:
        return [req for _, req in self.table.serving()]

    @property
    def alone(self) -> bool:
        """Whether a deterministic request holds the engine (no other request is assigned a slot meanwhile)."""
        return any(req.deterministic for _, req in self.table.serving())

    # ----------------------------------------------------------------------------------------------- schedule

    def schedule(self) -> Step:
        self._steps += 1
        step = Step()
        self._drop_cancelled(step)
        step.saves.extend(self._pinned_saves)
        self._pinned_saves.clear()
        self._cells_used = 0
        self._assign_waiting(step)
        budget = self.n_batch
        for slot, req in self.table.serving():
            if slot.state is SlotState.DECODE:
                budget -= self._add_decode(step, slot, req, budget)
        decode_rows = self.n_batch - budget
        prefills = [(s, r) for s, r in self.table.serving() if s.state is SlotState.PREFILL and not r.restoring]
        if self.pacing is not None and decode_rows and prefills:  # the budget's fit is only worth it for a prompt
            budget = self.pacing.prefill_tokens(decode_rows, budget)
        images: list[tuple[Slot[Request[Any]], Request[Any], int, int]] = []
        for slot, req in prefills:
            if budget > 0:
                budget -= self._add_prefill_chunk(step, slot, req, min(budget, self._prefill_cells(step)), images)
        for slot, req, start, end in images:  # after every token row: the backend decodes image rows first
            for pos in range(start, end):
                step.batch.add(req.prompt[pos], pos, slot.seq, False)
        if self.kv_cells is not None and not step:
            self._end_stalled_prefills(step)
        if not step and not self.waiting and not self.table.busy():
            self._save_ahead(step)
        return step

    def _save_ahead(self, step: Step) -> None:
        """Once nothing runs, save one idle cache of a shared pool that the next request to start would give up
        (_assign_waiting): it stays in its slot, and that request's step trims it with no copy to wait for
        (docs/benchmark-notes.md, "Saves ahead"). The most recently used cache is left alone: it is the likeliest
        to be continued in place. One a step, so that a request arriving meanwhile waits for one copy at most."""
        slot = self._next_to_save_ahead()
        if slot is not None:
            self._save_before_loss(step, slot, keeps=0)
            self._offered[slot.seq] = slot.last_used

    def _next_to_save_ahead(self) -> Slot[Request[Any]] | None:
        if self.kv_cells is None or self.cache is None:
            return None
        cached = sorted((s for s in self.table.free() if s.cached), key=lambda s: s.last_used)
        return next((s for s in cached[:-1] if self._offered.get(s.seq) != s.last_used), None)

    def _end_stalled_prefills(self, step: Step) -> None:
        """Nothing could run and no cells are free: a prefill that cannot advance ends rather than spin."""
        for slot, req in self.table.serving():
            if slot.state is SlotState.PREFILL and not req.restoring and not step.cache_ops:
                log.warning("the KV pool of %s cells is full: request %d ends unread", self.kv_cells, req.id)
                self.finish(req, "length")
                step.finished.append(req)

    def _prefill_cells(self, step: Step) -> int:
        """Cells a prefill chunk may take now (idle caches given up when none are free). A prefill can outgrow its
        reservation only when a restore failed for want of contiguous cells; see _end_stalled_prefills."""
        free = self.cells_free()
        if free == 0 and self.kv_cells is not None:
            free = self._give_up_idle(step, 1)
        return free

    # ----------------------------------------------------------------------------------------------- KV pool

    def cells_held(self) -> int:
        """KV cells the slots' caches hold (a prefix copied between slots counts for each: an upper bound)."""
        return sum(len(slot.cached) for slot in self.table.slots)

    def cells_free(self) -> int:
        """Cells of the pool no slot holds, less the rows of the step being built (a large number without a pool)."""
        if self.kv_cells is None:
            return self.n_batch
        return max(0, self.kv_cells - self.cells_held() - self._cells_used)

    def _reserved(self) -> int:
        """The prompt tokens admitted requests have still to prefill: cells kept for them."""
        return sum(
            len(req.prompt) - req.n_prefilled for slot, req in self.table.serving() if slot.state is SlotState.PREFILL
        )

    def _give_up_idle(
        self,
        step: Step,
        need: int,
        *,
        keep: tuple[Slot[Request[Any]] | None, ...] = (),
        which: Callable[[Slot[Request[Any]]], bool] = lambda slot: True,
    ) -> int:
        """Empty idle slots' caches (those `which` picks), coldest first, saved to the prefix cache first, until
        `need` cells are free; the cells now free."""
        free = self.cells_free()
        donors = step.donors  # trims run before copies: a donor of this step stays whole
        idle = sorted(
            (s for s in self.table.free() if s.cached and s not in keep and s.seq not in donors and which(s)),
            key=lambda s: s.last_used,
        )
        for slot in idle:
            if free >= need:
                break
            self._save_before_loss(step, slot, keeps=0)
            step.trims.append((slot.seq, 0))
            free += len(slot.cached)
            slot.cached, slot.floor = [], 0
        return free

    def _drop_cancelled(self, step: Step) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            req.done_reason = "cancelled"
            step.finished.append(req)
        for _, req in self.table.serving():
            if req.cancelled:
                self.finish(req, "cancelled")
                step.finished.append(req)

    def _assign_waiting(self, step: Step) -> None:
        """Give waiting requests slots; once some have started, the idle caches of a shared pool go to the prefix
        cache (saved first), as llama-server's --cache-idle-slots (its default, and off without its RAM cache) does:
        llama.cpp attends over every cell up to the highest one used, idle caches' too (docs/benchmark-notes.md).
        After every request of the step has its slot, so requests that arrive together each find their own cache.
        Where only restores start, those a save must keep go once their first tokens are out."""
        taken = self._take_slots(step)
        if self.kv_cells is None or self.cache is None:
            return
        if taken and self._only_restores_start():
            # A restore's step is copies alone, its first token the step after: a save would wait in it, so those
            # a save must keep go once that token is out. The restore frees the cells it needs in its own slot.
            self._give_up_idle(step, self.kv_cells, which=lambda slot: not self._unsaved(slot))
            self._held_back = {slot.seq for slot in self.table.free() if slot.cached}
        elif taken:
            # A prompt's cells go where the pool is free: given up now, idle caches leave it room below.
            self._give_up_idle(step, self.kv_cells)
            self._held_back.clear()
        if not self.table.busy():
            self._held_back.clear()  # nothing to slow down: they are saved ahead, and go when a request starts
        elif self._held_back and not self._first_tokens_pending():
            held, self._held_back = self._held_back, set()
            self._give_up_idle(step, self.kv_cells, which=lambda slot: slot.seq in held)

    def _first_tokens_pending(self) -> bool:
        return any(slot.state is SlotState.PREFILL for slot, _ in self.table.serving())

    def _only_restores_start(self) -> bool:
        """Whether every request before its first token restores a saved prefix in this step."""
        return all(req.restoring for slot, req in self.table.serving() if slot.state is SlotState.PREFILL)

    def _take_slots(self, step: Step) -> int:
        """Waiting requests take slots in order while they can; how many did."""
        taken = 0
        while self.waiting:
            head = self.waiting[0]
            if _prefilling(head.follows):
                return taken  # its prompt's KV is being computed; once done, choose() finds it to copy
            if self.alone or (head.deterministic and self.table.busy()):
                # a deterministic request runs alone: it waits for the slots to empty, and others for it
                return taken
            # A deterministic request reuses nothing: it takes the coldest slot, whose cache is saved first.
            choice = self.table.choose([] if head.deterministic else head.prompt)
            if choice is None:
                return taken
            req = self.waiting[0]
            slot = choice.slot
            if req.deterministic and self.kv_cells is not None:
                # In a shared pool a sequence's cells land where others left room, which changes llama.cpp's sums:
                # a deterministic request starts from an empty pool (idle caches saved first), the same cells each time.
                self._give_up_idle(step, self.kv_cells)
            # Keep at least the last prompt token to decode: its output is the first generated token.
            reuse = min(choice.reuse, len(req.prompt) - 1)
            saved = None if req.deterministic else self._saved_prefix(req.prompt, beats=reuse)
            if saved is not None:
                choice = SlotChoice(slot=self._restore_target(step, choice.slot), reuse=0)
                slot = choice.slot
            if not self._pool_fits(step, req, choice, reuse, saved):
                if self.table.busy():
                    return taken  # it waits for cells: requests ahead of it end, or idle caches go
                # Nothing runs that could free cells: waiting would be forever. Its own slot alone always fits.
                choice, saved = self._plain_choice(choice, req), None
                reuse = choice.reuse
                if not self._pool_fits(step, req, choice, reuse, saved):  # a prompt under n_ctx always fits
                    log.warning("request %d does not fit the empty KV pool of %s cells", req.id, self.kv_cells)
                    self.waiting.popleft()
                    req.done_reason = "length"
                    step.finished.append(req)
                    continue
            self.waiting.popleft()
            own = reuse if saved is None and choice.copy_from is None else 0
            self._save_before_loss(step, slot, keeps=own)
            if saved is not None:
                reuse = saved.reuse
                step.restores.append(Restore(slot.seq, saved.entry, reuse, req))
                slot.floor, req.cache_tier, req.restoring = saved.entry.floor, saved.tier, True
            elif choice.copy_from is not None and reuse > 0:
                step.copies.append((choice.copy_from.seq, slot.seq, reuse))
                slot.floor = choice.copy_from.floor
            elif len(slot.cached) > reuse:
                step.trims.append((slot.seq, reuse))
            if saved is None:
                req.cache_tier = "slot" if reuse else None
                slot.floor = slot.floor if reuse else 0
            slot.cached = req.prompt[:reuse]
            slot.state, slot.request, slot.last_used = SlotState.PREFILL, req, self._steps
            req.slot, req.n_cached, req.n_prefilled = slot, reuse, reuse
            taken += 1
        return taken

    def _plain_choice(self, choice: SlotChoice[Request[Any]], req: Request[Any]) -> SlotChoice[Request[Any]]:
        """`choice`'s slot with only what its own cache shares with the prompt: no copy from another slot."""
        prompt = [] if req.deterministic else req.prompt
        return SlotChoice(slot=choice.slot, reuse=min(self.table.usable(choice.slot, prompt), len(req.prompt) - 1))

    def _pool_fits(
        self, step: Step, req: Request[Any], choice: SlotChoice[Request[Any]], reuse: int, saved: Match | None
    ) -> bool:
        """Whether the pool holds `req`'s prompt and its first token in `choice.slot` (giving up idle caches for
        it); prompts that fit a slot's context always fit the pool once the others end."""
        if self.kv_cells is None:
            return True
        kept = saved.reuse if saved is not None else reuse
        need = restore_cells(len(req.prompt), saved) if saved is not None else len(req.prompt) - kept + 1
        slot = choice.slot
        spare = len(slot.cached) - kept - self._reserved()  # the slot's own cache beyond what it keeps is freed
        if self.cells_free() + spare >= need:
            return True
        donor = choice.copy_from if saved is None else None  # a restore copies nothing: its donor may go
        free = self._give_up_idle(step, need - spare, keep=(slot, donor))
        return free + spare >= need

    def _saved_prefix(self, prompt: list[int], *, beats: int) -> Match | None:
        """A saved prefix worth restoring: one that skips more tokens than the best slot, at a price that pays."""
        if self.cache is None:
            return None
        match = self.cache.lookup(prompt, fits=self._restorable)
        return match if match is not None and self.cache.price.pays(match, match.reuse - beats) else None

    def _restorable(self, prompt_len: int, match: Match) -> bool:
        """Whether restoring `match` for a prompt of `prompt_len` tokens could ever fit: the state in a slot's
        context, and with the prompt's rest in the pool once every other cache is gone (a state saved by a load
        with a longer context, or a long one beside a long prompt, never does; waiting for it would be forever)."""
        if match.entry.n_tokens > self.n_ctx:
            return False
        # _pool_fits with every other cache gone: the pool less what the prompt keeps of the state
        return self.kv_cells is None or restore_cells(prompt_len, match) + match.reuse <= self.kv_cells

    def _restore_target(self, step: Step, chosen: Slot[Request[Any]]) -> Slot[Request[Any]]:
        """The free slot a restore overwrites: one whose cache needs no save first (an empty one before a held
        one), the coldest of them; the share a slot's cache has with the prompt is moot, the restore replaces it.
        Restores run before copies: a donor of this step is not overwritten."""
        donors = step.donors
        free = [s for s in self.table.free() if s.seq not in donors] or [chosen]
        return min(free, key=lambda s: (self._unsaved(s), len(s.cached) > 0, s.last_used))

    def _unsaved(self, slot: Slot[Request[Any]], *, keeps: int = 0) -> bool:
        """Whether losing the slot's cache beyond `keeps` tokens would lose SAVE_MIN_TOKENS or more that no saved
        entry holds."""
        if self.cache is None or len(slot.cached) - keeps < SAVE_MIN_TOKENS:
            return False
        return not self.cache.holds(slot.cached)

    def _save_before_loss(self, step: Step, slot: Slot[Request[Any]], *, keeps: int) -> None:
        """Save the slot's state when it is about to lose SAVE_MIN_TOKENS or more that no saved entry holds."""
        if not self._unsaved(slot, keeps=keeps):
            return
        if any(save.seq == slot.seq for save in step.saves):
            return  # already saved this step (a keep_prefix request just ended there)
        step.saves.append(Save(slot.seq, tuple(slot.cached)))

    def restored(self, request: Request[Any], ok: bool) -> None:
        """The engine ran a step's Restore for `request`; on failure its prompt is prefilled from the start."""
        request.restoring = False
        slot = request.slot
        if ok or slot is None or slot.request is not request:
            return
        slot.cached, slot.floor = [], 0
        request.n_cached = request.n_prefilled = 0
        request.cache_tier = None

    def in_batch(self, step: Step) -> dict[Request[Any], int]:
        """The requests with rows in the step's batch, each with the first position it decodes there."""
        first: dict[Request[Any], int] = {}
        for seq, pos in zip(step.batch.seqs, step.batch.positions):
            req = self.table.slots[seq].request
            if req is not None:
                first[req] = min(pos, first.get(req, pos))
        return first

    def rewind(self, step: Step, *, restart: list[Request[Any]]) -> list[tuple[int, int]]:
        """Undo a step whose decode failed so that it can run again: `restart` (requests whose restored prefix the
        decode refused) prefill their prompts from the start, the others repeat their rows. The (seq, keep) cuts
        that leave each slot's KV as this bookkeeping says."""
        cuts = []
        for req, start in self.in_batch(step).items():
            slot = req.slot
            if slot is None:
                continue
            if req in restart:
                slot.cached, slot.floor = [], 0
                req.n_cached = req.n_prefilled = 0
                req.cache_tier = None
                start = 0
            elif slot.state is SlotState.PREFILL:
                req.n_prefilled = start
            cuts.append((slot.seq, start))
        return cuts

    def _add_decode(self, step: Step, slot: Slot[Request[Any]], req: Request[Any], budget: int) -> int:
        cells = self._decode_cells(step)
        if cells < 1:
            log.warning(
                "the KV pool of %d cells is full: request %d ends at %d tokens", self.kv_cells, req.id, len(slot.cached)
            )
            self.finish(req, "length")
            step.finished.append(req)
            return 0
        draft = req.draft[: max(0, min(self.draft_room(req), budget - 1, cells - 1))]
        req.draft = draft
        pos = len(slot.cached)
        tokens = [req.generated[-1], *draft]
        rows = [step.batch.add(tok, pos + i, slot.seq, True) for i, tok in enumerate(tokens)]
        step.work.append(SlotWork(req, rows, draft))
        slot.last_used = self._steps
        self._cells_used += len(rows)
        return len(rows)

    def _decode_cells(self, step: Step) -> int:
        """Cells a decode row and its drafts may take: what the pool has beyond the prefills' reservations."""
        if self.kv_cells is None:
            return self.n_batch
        reserved = self._reserved()
        free = self.cells_free() - reserved
        if free < 1:
            free = self._give_up_idle(step, reserved + 1) - reserved
        return free

    def _add_prefill_chunk(
        self,
        step: Step,
        slot: Slot[Request[Any]],
        req: Request[Any],
        budget: int,
        images: list[tuple[Slot[Request[Any]], Request[Any], int, int]],
    ) -> int:
        start = req.n_prefilled
        if is_placeholder(req.prompt[start]):
            return self._add_image_run(step, slot, req, images)
        stop = _text_end(req.prompt, start) if req.images else len(req.prompt)
        end = self._chunk_end(start, min(stop, start + budget), stop)
        last_row = -1
        for pos in range(start, end):
            last_row = step.batch.add(req.prompt[pos], pos, slot.seq, pos == len(req.prompt) - 1)
        if end == len(req.prompt):
            step.work.append(SlotWork(req, [last_row]))
        req.n_prefilled = end
        self._cells_used += end - start
        return end - start

    def _add_image_run(
        self,
        step: Step,
        slot: Slot[Request[Any]],
        req: Request[Any],
        images: list[tuple[Slot[Request[Any]], Request[Any], int, int]],
    ) -> int:
        """An image's placeholders are prefilled whole, in a step with room for them (the engine refuses an image
        longer than num_batch); the rows are added after the step's token rows. Pacing does not shrink them: an
        image would otherwise wait for as long as others decode."""
        start = req.n_prefilled
        end = _text_start(req.prompt, start)
        n = end - start
        room = self.n_batch - len(step.batch) - sum(e - s for _, _, s, e in images)
        if n > room or n > self.cells_free():
            return 0
        images.append((slot, req, start, end))
        req.n_prefilled = end
        self._cells_used += n
        return n

    def _chunk_end(self, start: int, end: int, prompt_end: int) -> int:
        """Where a prefill chunk should stop: on a multiple of `kv_pad` (the backend attends over spans of that many
        cells) when that drops fewer tokens than a nearly empty span would waste; the prompt's last chunk ends there.
        (docs/benchmark-notes.md, "Rules in the code".)"""
        cut = end % self.kv_pad
        if end < prompt_end and 0 < cut < self.kv_pad - cut and end - cut > start:
            return end - cut
        return end

    # ----------------------------------------------------------------------------------------------- update

    def update(self, step: Step, sampled: dict[int, list[int]]) -> None:
        """Record a decoded step. `sampled[request.id]` holds the tokens accepted for that request this step: one,
        or up to 1 + len(draft) when drafts were verified."""
        for slot, req in self.table.serving():
            if slot.state is SlotState.PREFILL:
                slot.cached = req.prompt[: req.n_prefilled]
        for work in step.work:
            req, served = work.request, work.request.slot
            if served is None or req.finished or served.request is not req:
                continue
            slot = served
            tokens = sampled.get(req.id, [])
            if slot.state is SlotState.PREFILL:
                slot.state = SlotState.DECODE
            else:
                # The decode row's input and the drafts that matched are now valid KV; the engine removes the rest.
                slot.cached.append(req.generated[-1])
                slot.cached.extend(work.draft[: len(tokens) - 1])
            req.generated.extend(tokens)

    def finish(self, request: Request[Any], reason: str) -> None:
        request.done_reason = request.done_reason or reason
        slot = request.slot
        if slot is not None and slot.request is request:
            if slot.state is SlotState.PREFILL:
                slot.cached = list(request.prompt[: request.n_prefilled])
            slot.state, slot.request = SlotState.IDLE, None
            if request.keep_prefix and self.cache is not None and slot.cached and reason != "error":
                self._pinned_saves.append(Save(slot.seq, tuple(slot.cached), pinned=True))

    def draft_room(self, request: Request[Any]) -> int:
        """How many draft tokens a generating request could still use this step: the decode row yields one token,
        so drafts fill at most the rest of its num_predict and of its context."""
        slot = request.slot
        context = self.n_ctx - len(slot.cached) - 1 if slot else 0
        tokens = request.max_tokens - len(request.generated) - 1
        return max(0, int(min(context, tokens)))

    def context_left(self, request: Request[Any]) -> int:
        slot = request.slot
        return self.n_ctx - len(slot.cached) if slot else self.n_ctx
