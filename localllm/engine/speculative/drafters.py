"""Drafters: each request's source of draft tokens (n-gram prompt lookup, a draft model, the target's MTP head), and a
wrapper that stops a draft at the first token the request's grammar forbids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...backends.base import Batch, DraftSource, GrammarProbe, greedy_pick
from ...errors import InvalidInput
from .policy import DraftWindow

if TYPE_CHECKING:
    from ...backends.base import LoadedModel


class Drafter(Protocol):
    """One request's source of draft tokens. The engine thread is the only caller."""

    kind: str
    insists: bool  # drafts even where drafting cannot pay (the request set spec_min_draft): no gate skips it

    def propose(self, tokens: Sequence[int], *, seq: int, busy_slots: int, room: int) -> list[int]:
        """At most `room` draft tokens to follow `tokens` (the request's prompt and output so far, in the slot whose
        sequence id is `seq`); [] skips speculation this step. `room` is what the request can still use: tokens past
        its num_predict or its context could never be emitted, so drafting them would only cost rows."""

    def feedback(self, *, drafted: int, accepted: int) -> None:
        """How many draft tokens were verified last step, and how many of them the target agreed with."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------- n-gram

NGRAM_SIZES = (4, 3, 2, 1)
MATCH_CAP = 64  # how far back a match is measured: beyond this, a copy is a copy


class PromptLookup:
    """Every n-gram of a growing token list mapped to the position where it last ended, so that each step finds the
    latest earlier occurrence of the list's ending in constant time (prompt lookup decoding).

    The n-gram that ends at the list's last token is the query itself, so it is indexed one step later."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self._indexed:  # not the list we indexed (lists only grow): start again
            self.__init__(self.sizes)  # type: ignore[misc]
        for end in range(self._indexed, len(tokens) - 1):
            for n, index in self._last_end.items():
                if end + 1 >= n:
                    index[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[list[int], int]:
        """(up to `limit` tokens after the latest earlier occurrence of the longest matching ending (of at most
        max(sizes) tokens), how many tokens that occurrence matches going back); ([], 0) when nothing matches."""
        self.extend(tokens)
        for n in self.sizes:
            if len(tokens) < n:
                continue
            end = self._last_end[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end + 1 : min(len(tokens), end + 1 + limit)]), match_length(tokens, end)
        return [], 0


def match_length(tokens: Sequence[int], end: int) -> int:
    """How many tokens up to `end` equal the list's last ones (capped at MATCH_CAP)."""
    last = len(tokens) - 1
    n = 0
    while n < MATCH_CAP and end - n >= 0 and tokens[end - n] == tokens[last - n]:
        n += 1
    return n


def lookup_draft(tokens: Sequence[int], limit: int, sizes: Sequence[int] = NGRAM_SIZES) -> tuple[list[int], int]:
    """Prompt lookup by brute force: the reference PromptLookup is tested against."""
    for n in sorted(sizes, reverse=True):
        if len(tokens) <= n:
            continue
        tail = list(tokens[len(tokens) - n :])
        for end in range(len(tokens) - 2, n - 2, -1):
            if list(tokens[end + 1 - n : end + 1]) == tail:
                return list(tokens[end + 1 : end + 1 + limit]), match_length(tokens, end)
    return [], 0


def ngram_confidence(match: int) -> float:
    """A continuation after a long match is likely a copy in progress; after one token, a guess."""
    return 1.0 - 0.5 / max(1, match)


class NgramDrafter:
    """Drafts from the request's own prompt and output: no second model. Strong when the answer repeats its input
    (code edits, quoting, structured extraction)."""

    kind = "ngram"

    def __init__(self, window: DraftWindow):
        self.window = window
        self.insists = window.floor > 0
        self._index = PromptLookup()

    def propose(self, tokens: Sequence[int], *, seq: int, busy_slots: int, room: int) -> list[int]:
        if not self.window.start(busy_slots=busy_slots, room=room).pays():
            return []  # not even a certain draft would pay this step: skip the lookup (the index catches up later)
        draft, match = self._index.lookup(tokens, min(self.window.limit, room))
        if not draft:
            return []
        keep = self.window.cut([ngram_confidence(match)] * len(draft), busy_slots=busy_slots)
        return draft[:keep]

    def feedback(self, *, drafted: int, accepted: int) -> None:
        self.window.record(drafted=drafted, accepted=accepted)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------- draft model


def check_same_vocab(target: LoadedModel, draft: LoadedModel, *, draft_name: str) -> None:
    """A draft model must spell every token the target knows the same way; InvalidInput names the first difference.

    Vocabularies may differ in size by padding only (as llama.cpp allows); drafts are then kept to the shared ids."""
    t, d = target.meta, draft.meta
    if abs(t.n_vocab - d.n_vocab) > 128:
        raise InvalidInput(
            f"draft model {draft_name} has {d.n_vocab} tokens but the model has {t.n_vocab}",
            hint="a draft model must share the model's tokenizer: pick one from the same family",
        )
    if (t.bos_token, t.eos_token) != (d.bos_token, d.eos_token):
        raise InvalidInput(
            f"draft model {draft_name} has BOS/EOS tokens {d.bos_token}/{d.eos_token} but the model "
            f"has {t.bos_token}/{t.eos_token}",
            hint="pick a draft model from the same family",
        )
    for token in range(min(t.n_vocab, d.n_vocab)):
        if target.token_bytes(token) != draft.token_bytes(token):
            raise InvalidInput(
                f"draft model {draft_name} spells token {token} as {draft.token_bytes(token)!r} but the "
                f"model spells it {target.token_bytes(token)!r}",
                hint="a draft model must share the model's tokenizer: pick one from the same family",
            )


class DraftModel:
    """A small model with the target's vocabulary, loaded beside it: its own context with one sequence per slot
    (the slot's seq id), and per sequence the tokens its KV holds, so a slot's next request reuses the shared prefix
    here too. Catching up is lazy: a draft decodes only the tokens its sequence lacks. A DraftSource."""

    def __init__(self, model: LoadedModel, *, name: str, n_vocab: int, threads: int = 0):
        self.model = model
        self.name = name
        self.n_vocab = n_vocab  # ids the target knows
        self.threads = threads  # of its decodes (0: the backend chooses)
        self.n_ctx = model.n_ctx
        self._cached: list[list[int]] = [[] for _ in range(model.n_seq)]
        self.seconds_per_token = 0.0  # what drafting one token costs (price())

    def price(self) -> None:
        """At the load, before any request: two tokens decoded one at a time at the start of sequence 0, then
        forgotten; the faster prices a draft token (the first may carry a fresh context's warm-up). Unpriced, a
        draft model looked free until its first trial, which could cost a whole prompt's catch-up on a backend
        where drafts never pay."""
        first = self.model.meta.bos_token if self.model.meta.bos_token is not None else 0
        measured = [self._timed(0, [token], start=pos) for pos, token in enumerate((first, first))]
        self._keep(0, 0)
        self.seconds_per_token = min(measured)

    def begin(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        cached = self._cached[seq]
        shared = 0
        limit = min(len(cached), len(tokens) - 1)  # the last token is always decoded again: its logits are needed
        while shared < limit and cached[shared] == tokens[shared]:
            shared += 1
        self._keep(seq, shared)
        row = -1
        for start in range(shared, len(tokens), self.model.n_batch):
            row = self._decode(seq, tokens[start : start + self.model.n_batch], start=start)
        return self.model.logits(row)

    def advance(self, seq: int, token: int, pos: int) -> np.ndarray:
        return self.model.logits(self._decode(seq, [token], start=pos))

    def end(self, seq: int, n_tokens: int) -> None:
        pass  # the drafted tokens stay cached until verification says how many to keep

    def accept(self, seq: int, *, start: int, accepted: int) -> None:
        self._keep(seq, start + accepted)

    def _keep(self, seq: int, n: int) -> None:
        """Forget all but the first `n` cached tokens of `seq` (rejected drafts)."""
        if len(self._cached[seq]) > n:
            self.model.remove(seq, n)
            del self._cached[seq][n:]

    def _decode(self, seq: int, tokens: Sequence[int], *, start: int) -> int:
        seconds = self._timed(seq, tokens, start=start)
        if len(tokens) == 1:  # the price of one drafted token, for the window's cost rule
            self.seconds_per_token += 0.2 * (seconds - self.seconds_per_token)
        return len(tokens) - 1

    def _timed(self, seq: int, tokens: Sequence[int], *, start: int) -> float:
        """Decode `tokens` into `seq` from `start`, the last row read out; the seconds it took on the step clock."""
        batch = Batch()
        for i, token in enumerate(tokens):
            batch.add(token, start + i, seq, i == len(tokens) - 1)
        t0 = self.model.step_clock()  # the same clock as the engine's step costs
        self.model.decode(batch)
        self._cached[seq].extend(tokens)
        return self.model.step_clock() - t0

    def close(self) -> None:
        self.model.close()


def draft_from(
    source: DraftSource, seq: int, tokens: Sequence[int], window: DraftWindow, *, busy_slots: int, room: int
) -> list[int]:
    """The drafting loop over any DraftSource: greedy tokens while the window finds each one worth its row."""
    room = min(room, source.n_ctx - len(tokens))
    run = window.start(busy_slots=busy_slots, draft_seconds=source.seconds_per_token, room=room)
    if room <= 0 or not run.pays() or not run.promising():
        return []
    logits = source.begin(seq, tokens)
    draft: list[int] = []
    try:
        while len(draft) < room:
            token, confidence = greedy_pick(logits)
            if token >= source.n_vocab or not run.offer(confidence):
                break
            draft.append(token)
            if len(draft) == room or not run.pays():
                break  # even a certain next token would not pay: skip its decode
            logits = source.advance(seq, token, len(tokens) + len(draft) - 1)
    finally:
        source.end(seq, len(tokens))
    return draft if run.worthwhile() else []


class SourceDrafter:
    """One request's view of a shared DraftSource (a draft model, or the target's MTP head): the same seq id as its
    slot in the target."""

    def __init__(self, source: DraftSource, window: DraftWindow, *, kind: str):
        self._source = source
        self.window = window
        self.insists = window.floor > 0
        self.kind = kind
        self._seq = 0
        self._start = 0  # length of `tokens` at the last proposal

    def propose(self, tokens: Sequence[int], *, seq: int, busy_slots: int, room: int) -> list[int]:
        self._seq, self._start = seq, len(tokens)
        return draft_from(self._source, seq, tokens, self.window, busy_slots=busy_slots, room=room)

    def feedback(self, *, drafted: int, accepted: int) -> None:
        self.window.record(drafted=drafted, accepted=accepted)
        if drafted:
            # The source holds the tokens and (some of) the draft after them: keep what the target agreed with.
            self._source.accept(self._seq, start=self._start, accepted=accepted)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------- grammar


class GrammarCheckedDrafter:
    """Wraps a drafter for a grammar-constrained request: the draft passes through the request's grammar and stops at
    the first token the grammar forbids (the target could never accept it, so verifying it would be wasted)."""

    def __init__(self, inner: Drafter, probe: GrammarProbe, *, n_prompt: int):
        self.inner = inner
        self.kind = inner.kind
        self.insists = inner.insists
        self._probe = probe
        self._n_prompt = n_prompt

    def propose(self, tokens: Sequence[int], *, seq: int, busy_slots: int, room: int) -> list[int]:
        draft = self.inner.propose(tokens, seq=seq, busy_slots=busy_slots, room=room)
        if not draft:
            return draft
        return draft[: self._probe.allowed(tokens[self._n_prompt :], draft)]

    def feedback(self, *, drafted: int, accepted: int) -> None:
        self.inner.feedback(drafted=drafted, accepted=accepted)

    def close(self) -> None:
        self.inner.close()
        self._probe.close()
