"""Speculative decoding: drafters that guess a request's next tokens cheaply, and the policy that sizes each guess.

Before every step the engine thread (engine/runner.py) asks each generating request's drafter for a draft; the
scheduler puts the draft rows into the same batch as the other slots' decode rows and prefill chunks; the engine
verifies them with the request's own sampler chain (the lossless rule is stated in ModelEngine._verify) and reports
how many were accepted. Rejected positions leave the target's KV there, and the drafter's own cache here.

    Drafter             per request: propose(tokens, busy_slots, room) -> draft; feedback(drafted, accepted); close()
    NgramDrafter        prompt lookup: continue the latest earlier occurrence of the text's current ending
    DraftModelDrafter   a small model with the same vocabulary: its own context, one sequence per slot
    MtpDrafter          the target's own multi-token-prediction heads (backends/llama_cpp_spec.py)
    DraftWindow         per request: how many draft tokens are worth verifying this step
    Speculation         per loaded model: builds each request's drafter from its spec_type (the pool's factory)
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import numpy as np

from .api import LoadOptions
from .backends.base import Batch
from .errors import InvalidInput, LocalLLMError

if TYPE_CHECKING:
    from pathlib import Path

    from .backends.base import LoadedModel
    from .engine.runner import GenerationParams
    from .scheduler import Request, Step
    from .store import ResolvedModel, Store

log = logging.getLogger(__name__)


class Drafter(Protocol):
    """One request's source of draft tokens. The engine thread is the only caller."""

    kind: str

    def propose(self, tokens: Sequence[int], *, busy_slots: int, room: int) -> list[int]:
        """At most `room` draft tokens to follow `tokens` (the request's prompt and output so far); [] skips
        speculation this step. `room` is what the request can still use: tokens past its num_predict or its context
        could never be emitted, so drafting them would only cost rows."""

    def feedback(self, *, drafted: int, accepted: int) -> None:
        """How many draft tokens were verified last step, and how many of them the target agreed with."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------- policy

class StepCost:
    """Seconds of a decode step of `rows` rows, all read out (decode rows and their drafts), modelled as
    a + b * rows and fitted by exponentially weighted least squares over the engine's decode steps. Steps that carry
    prefill chunks are left out: their rows skip the output layer and run faster kernels, and would make draft rows
    look cheaper than they are. A light prior, scaled to the first step seen, says extra rows are cheap (`prior` of a
    one-row step): optimistic, so drafts get tried and their real cost measured."""

    def __init__(self, *, prior: float = 0.05, memory: float = 0.999):
        # A long memory: costs are CPU seconds of the engine thread, steady for a loaded model, and what a few draft
        # steps taught about the slope must outlive the long runs of same-sized steps between them.
        self.prior = prior
        self.memory = memory
        # Decayed, row-weighted sums of the fit: weight, rows, rows², seconds, rows x seconds. Plain floats: this
        # runs after every decode step, speculating or not, and numpy's small arrays cost ten times more.
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)
        self._anchor: Optional[np.ndarray] = None  # prior coefficients, once a step gave them a scale
        self._coef = np.array([1.0, prior])  # in one-row steps until something is measured
        self._stale = False

    def record(self, rows: int, outputs: int, seconds: float) -> None:
        if rows <= 0 or outputs != rows or seconds <= 0:
            return
        if self._anchor is None:
            self._anchor = self._coef * seconds / float(self._coef[0] + self._coef[1] * rows)
        # Each step weighs as many as its rows: drafts are sized at the batch's size and above, and a step's cost
        # bends there (llama.cpp's kernels get more from each row in a wider batch), so the few small steps as
        # requests start and finish must not set the slope that large draft steps pay.
        m, w = self.memory, float(rows)
        n, sx, sxx, sy, sxy = self._sums
        self._sums = (m * n + w, m * sx + w * rows, m * sxx + w * rows * rows, m * sy + w * seconds,
                      m * sxy + w * rows * seconds)
        self._stale = True  # solved when a draft is next sized: steps with no speculating request never pay for it

    @property
    def coef(self) -> np.ndarray:
        if self._stale:
            # The prior decides only what the data cannot: while every step has the same rows, a and b cannot be
            # told apart, and the prior's cheap rows then get drafts tried where only the drafting request waits on
            # them (a lone request: see may_try).
            n, sx, sxx, sy, sxy = self._sums
            coef = np.linalg.solve(np.array([[n + 1.0, sx], [sx, sxx + 1.0]]), np.array([sy, sxy]) + self._anchor)
            self._coef = np.maximum(coef, [self._anchor[0] * 0.01, 0.0])
            self._stale = False
        return self._coef

    def seconds(self, rows: int) -> float:
        """Estimated seconds of a decode step of `rows` rows (in one-row steps before anything was measured)."""
        a, b = self.coef
        return float(a + b * rows)

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

    BANDS = 8  # band i holds confidences in [1 - 2^-i, 1 - 2^-(i+1)): finer near certainty, where runs get long
    MARGIN = 0.05

    @staticmethod
    def any_draft_pays(cost: StepCost, busy_slots: int) -> bool:
        """Could a draft of any window pay in a batch of `busy_slots`? (the module's any_draft_pays)"""
        return any_draft_pays(cost, busy_slots)

    def __init__(self, limit: int, cost: StepCost, *, memory: float = 0.95, prior_weight: float = 2.0,
                 margin: float = MARGIN):
        self.limit = limit
        self.cost = cost
        self.margin = margin
        self.memory = memory
        self.prior_weight = prior_weight
        self._hits = [0.0] * self.BANDS  # decayed counts per band: accepted tokens and verified tokens
        self._trials = [0.0] * self.BANDS
        self.offered: list[float] = []  # confidences of the draft last offered, to credit its band on record()

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
        return min(PER_TOKEN_CEILING,
                   (self._hits[b] + self.prior_weight * confidence) / (self._trials[b] + self.prior_weight))

    def start(self, *, busy_slots: int, draft_seconds: float = 0.0, room: Optional[int] = None) -> "DraftRun":
        """Begin sizing one step's draft of at most `room` tokens; `draft_seconds` is what drafting one token costs
        (a draft model's decode)."""
        self.offered = []
        limit = self.limit if room is None else max(0, min(self.limit, room))
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
        """Does the draft taken so far beat not drafting by the window's margin?"""
        rate = self._expected / self._seconds(self.position)
        return self.position > 0 and rate >= goal_rate(self.window.cost, self._busy, self.window.margin)

    def pays(self, confidence: float = 1.0) -> bool:
        """Would a next token with this confidence pay? (With 1.0: could any next token pay?)"""
        if self.position >= self.limit or not may_try(self.window.cost, self._busy):
            return False
        gain = self.survival * self.window.per_token(confidence)
        now, longer = self._seconds(self.position), self._seconds(self.position + 1)
        return (self._expected + gain) / longer >= self._expected / now

    def _seconds(self, drafts: int) -> float:
        return self.window.cost.seconds(self._busy + drafts) + drafts * self._draft_seconds


PER_TOKEN_CEILING = 0.995  # DraftWindow.per_token never believes a draft token more than this


def may_try(cost: StepCost, busy_slots: int) -> bool:
    """May a batch of `busy_slots` generating requests carry drafts at all? Once the per-row cost is measured, or
    when one request is alone: a trial then costs only the request that gambles on it.

    A draft that misses in a shared batch holds up every request in it, so a shared batch never pays for a trial,
    not even a short one of sure tokens: a dozen such trials, rejected, cost a batch of four 1-4% on smollm2, and
    with rows that cost as much as a one-row step (a CPU) even accepted drafts of one request only move work from
    the others. The cost is learned where trials are free for the rest: a lone request's drafts of varying length,
    and batches that shrink and grow as requests finish and arrive."""
    return busy_slots <= 1 or cost.identified


def goal_rate(cost: StepCost, busy_slots: int, margin: float) -> float:
    """Tokens per second a step with drafts must reach: a step without them, bettered by `margin` per busy slot."""
    return (1.0 + margin * busy_slots) * busy_slots / cost.seconds(busy_slots)


def any_draft_pays(cost: StepCost, busy_slots: int, *, margin: Optional[float] = None, limit: int = 64) -> bool:
    """Could any request's draft pay this step? The surest draft there can be (every token at the window's ceiling,
    drafting free) of any length up to `limit`, against the window's margin: if even that would not beat not
    drafting, no drafter need be asked (the engine skips them all)."""
    busy = max(1, busy_slots)
    if not may_try(cost, busy):
        return False
    goal = goal_rate(cost, busy, DraftWindow.MARGIN if margin is None else margin)
    expected, survival, best = float(busy), 1.0, 0.0
    for drafts in range(1, limit + 1):
        survival *= PER_TOKEN_CEILING
        expected += survival
        rate = expected / cost.seconds(busy + drafts)
        if rate >= goal:
            return True
        if rate < best:
            return False  # past the peak: a longer draft only adds rows that are less likely to count
        best = rate
    return False


class FixedWindow(DraftWindow):
    """Always drafts `limit` tokens, whatever they cost or however sure the drafter is (llama.cpp's fixed draft
    length): for tests that need drafts to happen, and benchmarks that compare against the adaptive window."""

    @staticmethod
    def any_draft_pays(cost: StepCost, busy_slots: int) -> bool:
        return True

    def start(self, *, busy_slots: int, draft_seconds: float = 0.0, room: Optional[int] = None) -> DraftRun:
        limit = self.limit if room is None else max(0, min(self.limit, room))
        return _FixedRun(self, busy_slots=busy_slots, draft_seconds=draft_seconds, limit=limit)


class _FixedRun(DraftRun):
    def pays(self, confidence: float = 1.0) -> bool:
        return self.position < self.limit

    def worthwhile(self) -> bool:
        return self.position > 0


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
                    index[tuple(tokens[end + 1 - n: end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[list[int], int]:
        """(up to `limit` tokens after the latest earlier occurrence of the longest matching ending (of at most
        max(sizes) tokens), how many tokens that occurrence matches going back); ([], 0) when nothing matches."""
        self.extend(tokens)
        for n in self.sizes:
            if len(tokens) < n:
                continue
            end = self._last_end[n].get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return list(tokens[end + 1: min(len(tokens), end + 1 + limit)]), match_length(tokens, end)
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
        tail = list(tokens[len(tokens) - n:])
        for end in range(len(tokens) - 2, n - 2, -1):
            if list(tokens[end + 1 - n: end + 1]) == tail:
                return list(tokens[end + 1: end + 1 + limit]), match_length(tokens, end)
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
        self._index = PromptLookup()

    def propose(self, tokens: Sequence[int], *, busy_slots: int, room: int) -> list[int]:
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

def check_same_vocab(target: "LoadedModel", draft: "LoadedModel", *, draft_name: str) -> None:
    """A draft model must spell every token the target knows the same way; InvalidInput names the first difference.

    Vocabularies may differ in size by padding only (as llama.cpp allows); drafts are then kept to the shared ids."""
    t, d = target.meta, draft.meta
    if abs(t.n_vocab - d.n_vocab) > 128:
        raise InvalidInput(f"draft model {draft_name} has {d.n_vocab} tokens but the model has {t.n_vocab}",
                           hint="a draft model must share the model's tokenizer: pick one from the same family")
    if (t.bos_token, t.eos_token) != (d.bos_token, d.eos_token):
        raise InvalidInput(f"draft model {draft_name} has BOS/EOS tokens {d.bos_token}/{d.eos_token} but the model "
                           f"has {t.bos_token}/{t.eos_token}", hint="pick a draft model from the same family")
    for token in range(min(t.n_vocab, d.n_vocab)):
        if target.token_bytes(token) != draft.token_bytes(token):
            raise InvalidInput(f"draft model {draft_name} spells token {token} as {draft.token_bytes(token)!r} but the "
                               f"model spells it {target.token_bytes(token)!r}",
                               hint="a draft model must share the model's tokenizer: pick one from the same family")


def greedy_pick(logits: np.ndarray) -> tuple[int, float]:
    """The most likely token and its probability."""
    token = int(np.argmax(logits))
    top = float(logits[token])
    return token, float(1.0 / np.exp(logits.astype(np.float64) - top).sum())


class DraftModel:
    """A small model with the target's vocabulary, loaded beside it: its own context with one sequence per slot
    (the slot's seq id), and per sequence the tokens its KV holds, so a slot's next request reuses the shared prefix
    here too. Catching up is lazy: a draft decodes only the tokens its sequence lacks."""

    def __init__(self, model: "LoadedModel", *, name: str, n_vocab: int):
        self.model = model
        self.name = name
        self.n_vocab = n_vocab  # ids the target knows
        self._cached: list[list[int]] = [[] for _ in range(model.n_seq)]
        self._n_batch = getattr(model, "n_batch", 512)
        self.seconds_per_token = 0.0

    def draft(self, seq: int, tokens: Sequence[int], window: DraftWindow, *, busy_slots: int, room: int) -> list[int]:
        room = min(room, self.model.n_ctx - len(tokens))
        run = window.start(busy_slots=busy_slots, draft_seconds=self.seconds_per_token, room=room)
        if room <= 0 or not run.pays():
            return []
        row = self._catch_up(seq, tokens)
        draft: list[int] = []
        while len(draft) < room:
            token, confidence = greedy_pick(self.model.logits(row))
            if token >= self.n_vocab or not run.offer(confidence):
                break
            draft.append(token)
            if len(draft) == room or not run.pays():
                break  # even a certain next token would not pay: skip its decode
            row = self._decode(seq, [token], start=len(tokens) + len(draft) - 1)
        return draft if run.worthwhile() else []

    def keep(self, seq: int, n: int) -> None:
        """Forget all but the first `n` cached tokens of `seq` (rejected drafts)."""
        if len(self._cached[seq]) > n:
            self.model.remove(seq, n)
            del self._cached[seq][n:]

    def _catch_up(self, seq: int, tokens: Sequence[int]) -> int:
        """Decode what `seq` lacks of `tokens`; returns the batch row whose logits follow the last token."""
        cached = self._cached[seq]
        shared = 0
        limit = min(len(cached), len(tokens) - 1)  # the last token is always decoded again: its logits are needed
        while shared < limit and cached[shared] == tokens[shared]:
            shared += 1
        self.keep(seq, shared)
        row = -1
        for start in range(shared, len(tokens), self._n_batch):
            row = self._decode(seq, tokens[start: start + self._n_batch], start=start)
        return row

    def _decode(self, seq: int, tokens: Sequence[int], *, start: int) -> int:
        batch = Batch()
        for i, token in enumerate(tokens):
            batch.add(token, start + i, seq, i == len(tokens) - 1)
        t0 = time.thread_time()  # the same clock as the engine's step costs
        self.model.decode(batch)
        if len(tokens) == 1:  # the price of one drafted token, for the window's cost rule
            seconds = time.thread_time() - t0
            self.seconds_per_token += 0.2 * (seconds - self.seconds_per_token)
        self._cached[seq].extend(tokens)
        return len(tokens) - 1

    def close(self) -> None:
        self.model.close()


class DraftModelDrafter:
    """One request's view of the shared DraftModel: the same seq id as its slot in the target."""

    kind = "draft"

    def __init__(self, model: DraftModel, request: "Request", window: DraftWindow):
        self._model = model
        self._request = request
        self.window = window
        self._start = 0  # length of `tokens` at the last proposal

    def propose(self, tokens: Sequence[int], *, busy_slots: int, room: int) -> list[int]:
        slot = self._request.slot  # assigned at schedule time, after this drafter was made
        if slot is None:
            return []
        self._start = len(tokens)
        return self._model.draft(slot.seq, tokens, self.window, busy_slots=busy_slots, room=room)

    def feedback(self, *, drafted: int, accepted: int) -> None:
        self.window.record(drafted=drafted, accepted=accepted)
        slot = self._request.slot
        if drafted and slot is not None:
            # The draft KV holds the tokens and (some of) the draft after them: keep what the target agreed with.
            self._model.keep(slot.seq, self._start + accepted)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------- MTP

class MtpDrafter:
    """One request's view of the target's MTP head (backends/llama_cpp_spec.MtpHead), which follows every target
    decode on its own and drafts from the target's last hidden state."""

    kind = "mtp"

    def __init__(self, head, request: "Request", window: DraftWindow):
        self._head = head
        self._request = request
        self.window = window
        self._start = 0

    def propose(self, tokens: Sequence[int], *, busy_slots: int, room: int) -> list[int]:
        slot = self._request.slot
        if slot is None:
            return []
        self._start = len(tokens)
        return self._head.draft(slot.seq, tokens, self.window, busy_slots=busy_slots, room=room)

    def feedback(self, *, drafted: int, accepted: int) -> None:
        self.window.record(drafted=drafted, accepted=accepted)
        slot = self._request.slot
        if drafted and slot is not None:
            self._head.accept(slot.seq, start=self._start, accepted=accepted)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------- grammar

class GrammarCheckedDrafter:
    """Wraps a drafter for a grammar-constrained request: the draft passes through the request's grammar and stops at
    the first token the grammar forbids (the target could never accept it, so verifying it would be wasted)."""

    def __init__(self, inner: Drafter, probe, *, n_prompt: int):
        self.inner = inner
        self.kind = inner.kind
        self._probe = probe
        self._n_prompt = n_prompt

    def propose(self, tokens: Sequence[int], *, busy_slots: int, room: int) -> list[int]:
        draft = self.inner.propose(tokens, busy_slots=busy_slots, room=room)
        if not draft:
            return draft
        return draft[: self._probe.allowed(tokens[self._n_prompt:], draft)]

    def feedback(self, *, drafted: int, accepted: int) -> None:
        self.inner.feedback(drafted=drafted, accepted=accepted)

    def close(self) -> None:
        self.inner.close()
        self._probe.close()


# ---------------------------------------------------------------------------------------------------------- factory

class Speculation:
    """What one loaded model offers for speculative decoding, and each request's drafter.

    spec_type auto picks MTP when the weights carry MTP heads, else the Modelfile's DRAFT model when there is one,
    else n-gram lookup; none (or spec_max_draft 0) turns speculation off for that request."""

    def __init__(self, target: "LoadedModel", *, draft: Optional[DraftModel] = None, mtp=None,
                 window: Callable[[int, StepCost], DraftWindow] = DraftWindow):
        self.target = target
        self.draft_model = draft
        self.mtp = mtp
        self.cost = StepCost()
        self._window = window
        self._steps = 0
        self._gate: dict[int, tuple[int, bool]] = {}  # busy slots -> (step, could any draft pay)
        self._builders: dict[str, Callable] = {"ngram": lambda request, window: NgramDrafter(window)}
        if draft is not None:
            self._builders["draft"] = lambda request, window: DraftModelDrafter(draft, request, window)
        if mtp is not None:
            self._builders["mtp"] = lambda request, window: MtpDrafter(mtp, request, window)

    @property
    def kind(self) -> str:
        """The drafter `auto` picks (what `localllm ps` shows)."""
        return next(k for k in ("mtp", "draft", "ngram") if k in self._builders)

    def __call__(self, request: "Request", params: "GenerationParams") -> Optional[Drafter]:
        opts = params.sampling
        kind = self.kind if opts.spec_type == "auto" else opts.spec_type
        if kind == "none" or opts.spec_max_draft == 0:
            return None
        builder = self._builders.get(kind)
        if builder is None:
            raise InvalidInput(f"spec_type {kind!r} is not available for this model",
                               hint=_MISSING_HINT[kind] + f"; it offers {', '.join(sorted(self._builders))}")
        drafter = builder(request, self._window(opts.spec_max_draft, self.cost))
        if params.grammar:
            drafter = self._with_grammar(drafter, params.grammar, n_prompt=len(request.prompt))
        return drafter

    def _with_grammar(self, drafter: Drafter, grammar: str, *, n_prompt: int) -> Drafter:
        if not hasattr(self.target, "raw_handles"):  # only llama.cpp samples with grammars
            return drafter
        from .backends.llama_cpp_spec import GrammarProbe

        return GrammarCheckedDrafter(drafter, GrammarProbe(self.target, grammar), n_prompt=n_prompt)

    def may_draft(self, busy_slots: int) -> bool:
        """Before a step, on the engine thread: is it worth asking the drafters at all? (No: they are skipped.)
        The answer for a batch size is kept for GATE_STEPS steps: the step cost moves slowly."""
        steps, answer = self._gate.get(busy_slots, (-1, False))
        if steps < 0 or self._steps - steps >= GATE_STEPS:
            answer = getattr(self._window, "any_draft_pays", any_draft_pays)(self.cost, busy_slots)
            self._gate[busy_slots] = (self._steps, answer)
        return answer

    def observe(self, step: "Step") -> None:
        """After every target decode, before sampling (on the engine thread): the MTP head follows the batch."""
        if self.mtp is not None:
            self.mtp.observe(step)

    def record_step(self, step: "Step", seconds: float) -> None:
        """After sampling: what the step cost in CPU seconds of the engine thread (decode, MTP follow-up and
        sampling), for the draft window."""
        self.cost.record(len(step.batch), sum(step.batch.logits), seconds)
        self._steps += 1

    def close(self) -> None:
        """When the model unloads, on the engine thread: free the draft contexts."""
        if self.mtp is not None:
            self.mtp.close()
            self.mtp = None
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None


GATE_STEPS = 32

_MISSING_HINT = {
    "draft": "add a DRAFT line to the Modelfile (or the draft load option) naming a smaller model of the same family",
    "mtp": "only weights with MTP (nextn) layers have MTP heads",
}


def load_speculation(store: "Store", model: "ResolvedModel", load: LoadOptions,
                     loaded: "LoadedModel") -> Speculation:
    """The pool's drafter factory: called once per model load, on the loading thread, before the engine starts."""
    draft = None
    if load.draft:
        weights = store.resolve(load.draft).weights
        draft = open_draft_model(weights, load, loaded, name=load.draft)
    return Speculation(loaded, draft=draft, mtp=open_mtp_head(loaded))


def open_mtp_head(loaded: "LoadedModel"):
    """The model's MTP head when its weights carry one (llama.cpp only), else None."""
    if not loaded.meta.has_mtp or not hasattr(loaded, "raw_handles"):
        return None
    from .backends.llama_cpp_spec import MtpHead

    try:
        return MtpHead(loaded)  # type: ignore[arg-type]
    except LocalLLMError as exc:  # e.g. nextn layers this llama.cpp cannot run as a head: speculate without them
        log.warning("MTP head unavailable: %s", exc)
        return None


def open_draft_model(weights: "Path", load: LoadOptions, target: "LoadedModel", *, name: str) -> DraftModel:
    """Load a draft model beside `target` (same slots and context per slot), checking it shares the vocabulary."""
    from .backends import choose_backend, get_backend

    options = load.model_copy(update={"draft": None})
    model = get_backend(choose_backend(options.backend, weights)).load(weights, options, n_seq=target.n_seq,
                                                                       n_ctx=target.n_ctx)
    try:
        check_same_vocab(target, model, draft_name=name)
    except BaseException:
        model.close()
        raise
    log.info("draft model %s loaded beside the model: %d slots x %d tokens", name, model.n_seq, model.n_ctx)
    return DraftModel(model, name=name, n_vocab=target.meta.n_vocab)
