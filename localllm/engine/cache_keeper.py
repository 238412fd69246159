"""The engine thread's hands on the prefix cache: it carries out the saves and restores a step asks for, writes the
prefixes out when the model unloads, and exports and imports states for prompt-cache files. The scheduler decides;
this moves bytes between the backend's sequences and the cache (engine/prefix_cache.py)."""

from __future__ import annotations

import logging
import time

from ..backends.base import LoadedModel
from ..errors import InvalidInput, LocalLLMError
from .prefix_cache import (
    SAVE_MIN_TOKENS,
    CacheFileError,
    Entry,
    PrefixCache,
    as_tokens,
    decode_state,
    encode_state,
    shared_length,
)
from .scheduler import Restore, Save, Scheduler, Step

log = logging.getLogger(__name__)


class CacheKeeper:
    def __init__(self, model: LoadedModel, cache: PrefixCache | None, scheduler: Scheduler):
        self.model = model
        self.cache = cache
        self._scheduler = scheduler

    def apply(self, step: Step) -> bool:
        """Run the step's saves, then its restores (before its trims and copies); True when the cache changed.
        The states to restore are read first: a save may evict the very entry a restore wants."""
        states = [(restore, restore.entry.tier, *self._read(restore)) for restore in step.restores]
        for save in step.saves:
            self._save(save)
        for restore, tier, data, read_seconds in states:
            if data is not None:
                self._restore(restore, data, tier, read_seconds)
            else:  # the slot's old cache goes as planned, and the prompt starts afresh
                self.model.remove(restore.seq, 0)
                self._scheduler.restored(restore.request, ok=False)
        return bool(step.saves or step.restores)

    def _read(self, restore: Restore) -> tuple[bytes | None, float]:
        """The entry's state, and the seconds it took (a disk tier's read is part of a restore's price)."""
        assert self.cache is not None
        started = time.perf_counter()
        try:
            return self.cache.load(restore.entry), time.perf_counter() - started
        except CacheFileError as exc:  # the cache has already dropped the file
            log.warning("prefix cache: %s", exc)
            return None, 0.0

    def _save(self, save: Save) -> None:
        assert self.cache is not None
        states = self.model.states
        data = states.save_seq(save.seq) if states is not None else None
        if data is not None:
            self.cache.put(save.tokens, data, pinned=save.pinned)

    def _restore(self, restore: Restore, data: bytes, tier: str, read_seconds: float) -> None:
        """Load a saved prefix into the request's slot; on any failure the request prefills its whole prompt."""
        cache, entry, states = self.cache, restore.entry, self.model.states
        assert cache is not None and states is not None  # an entry exists only where states were saved
        started = time.perf_counter()
        try:
            states.restore_seq(restore.seq, data, entry.n_tokens)
        except LocalLLMError as exc:
            log.warning("prefix cache: dropping an entry of %d tokens: %s", entry.n_tokens, exc)
            cache.drop(entry)
            self._scheduler.restored(restore.request, ok=False)
            return
        cache.price.observe_restore(tier, len(data), read_seconds + time.perf_counter() - started)
        if restore.keep < entry.n_tokens:
            self.model.remove(restore.seq, restore.keep)
        cache.hit(entry)
        restore.request.unconfirmed = entry  # until a decode continues from it (confirm, or discard)
        self._scheduler.restored(restore.request, ok=True)

    def confirm(self, entry: Entry) -> None:
        """A decode continued from a restored `entry`: it held what it claimed."""
        if self.cache is not None:
            self.cache.confirm(entry)

    def discard(self, entry: Entry) -> None:
        """The first decode after restoring `entry` failed: it goes from RAM and disk, never to fail again."""
        log.warning("prefix cache: dropping an entry of %d tokens that its next decode refused", entry.n_tokens)
        if self.cache is not None:
            self.cache.drop(entry)

    def keep_on_disk(self) -> None:
        """On unload with a disk tier: save what the slots hold and write the RAM tier out, so a restarted server
        finds every prefix again."""
        cache = self.cache
        if cache is None or cache.disk is None:
            return
        try:
            for slot in self._scheduler.table.slots:
                if len(slot.cached) >= SAVE_MIN_TOKENS and not cache.holds(slot.cached):
                    self._save(Save(slot.seq, tuple(slot.cached)))
            cache.flush()
        except Exception:  # the prefixes are a convenience: an unload must finish whatever happens here
            log.exception("could not write the prefix cache to disk")

    # ----------------------------------------------------------------------------------------------- files

    def export(self, tokens: list[int]) -> bytes:
        """The longest cached prefix of `tokens` (a slot's or a saved one) in the prefix cache's file format."""
        cache = self._cache_for_files()
        wanted = as_tokens(tokens)
        table = self._scheduler.table
        slot = max(table.slots, key=lambda s: table.usable(s, tokens, keep_last=False))
        in_slot = table.usable(slot, tokens, keep_last=False)
        entry = max(cache.entries, key=lambda e: shared_length(e.tokens, wanted), default=None)
        in_entry = shared_length(entry.tokens, wanted) if entry is not None else 0
        if max(in_slot, in_entry) == 0:
            raise InvalidInput("nothing of this conversation is in the prompt cache", hint="send a message first")
        if in_slot >= in_entry:
            states = self.model.states
            data = states.save_seq(slot.seq) if states is not None else None
            if data is None:
                raise InvalidInput("this backend cannot save sequence states")
            held = as_tokens(slot.cached)
            return b"".join(
                encode_state(
                    cache.digest, cache.shape.fingerprint, held, cache.shape.saved_floor(len(slot.cached)), data
                )
            )
        assert entry is not None
        return b"".join(
            encode_state(cache.digest, cache.shape.fingerprint, entry.tokens, entry.floor, cache.load(entry))
        )

    def import_(self, blob: bytes) -> int:
        """Pin a state from export() in the cache, scoped to its own conversation until a request continues from
        it; the number of tokens it holds. Only states this server's key signed are taken."""
        cache = self._cache_for_files()
        try:
            state = decode_state(blob, cache.digest, cache.shape.fingerprint)
        except CacheFileError as exc:
            raise InvalidInput(
                f"the prompt cache cannot be loaded: {exc}",
                hint="only files saved by this server (its key under LOCALLLM_HOME), with the same model, build "
                "and load options, can be loaded",
            ) from None
        if state.tokens.shape[0] >= self.model.n_ctx:
            raise InvalidInput(
                f"the prompt cache holds {state.tokens.shape[0]:,} tokens, more than this load's context "
                f"({self.model.n_ctx:,})"
            )
        if cache.put(state.tokens.tolist(), state.data, pinned=True, scoped=True) is None:
            raise InvalidInput(
                f"the prompt cache ({len(state.data):,} bytes) does not fit in the prefix cache",
                hint="raise LOCALLLM_CACHE_RAM",
            )
        return int(state.tokens.shape[0])

    def _cache_for_files(self) -> PrefixCache:
        if self.cache is None or not self.cache.shape.fingerprint:
            raise InvalidInput(
                "prompt-cache files need the prefix cache, which is off for this model",
                hint="set LOCALLLM_CACHE_RAM above 0 (and use the llama.cpp backend)",
            )
        return self.cache
