"""Speculation: what one loaded model offers for speculative decoding, and the drafter each request gets."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ...api import DraftProcess, LoadOptions, SamplingOptions
from ...backends.base import Batch, LoadCheck, MtpHead
from ...errors import InvalidInput, LocalLLMError
from ...machine import physical_cores
from .drafters import Drafter, DraftModel, GrammarCheckedDrafter, NgramDrafter, SourceDrafter, check_same_vocab
from .policy import DepthCosts, DraftWindow

if TYPE_CHECKING:
    from pathlib import Path

    from ...backends.base import LoadedModel
    from ...models.store import ResolvedModel, Store

log = logging.getLogger(__name__)


GATE_STEPS = 32

_MISSING_HINT = {
    "draft": "add a DRAFT line to the Modelfile (or the draft load option) naming a smaller model of the same family",
    "mtp": "only weights with MTP (nextn) layers have MTP heads",
}


class Speculation:
    """What one loaded model offers for speculative decoding, and each request's drafter.

    spec_type auto picks MTP when the weights carry MTP heads, else the Modelfile's DRAFT model when there is one,
    else n-gram lookup; none (or spec_max_draft 0) turns speculation off for that request. The engine thread calls
    every method but the constructor."""

    def __init__(
        self,
        target: LoadedModel,
        *,
        draft: DraftModel | None = None,
        mtp: MtpHead | None = None,
        window: type[DraftWindow] = DraftWindow,
        draft_check: LoadCheck | None = None,
    ):
        self.target = target
        self.draft_model = draft
        self._draft_check = draft_check  # what the draft's load check left for after the load (loaded())
        self.mtp = mtp
        self.cost = DepthCosts()
        self._window = window
        self._steps = 0
        self._gate: dict[tuple[int, int], tuple[int, bool]] = {}  # (busy slots, band) -> (step, any pays)
        self._builders: dict[str, Callable[[DraftWindow], Drafter]] = {"ngram": NgramDrafter}
        if draft is not None:
            self._builders["draft"] = lambda window: SourceDrafter(draft, window, kind="draft")
        if mtp is not None:
            self._builders["mtp"] = lambda window: SourceDrafter(mtp, window, kind="mtp")

    def loaded(self, done: Callable[[], None]) -> None:
        """Begin what the draft's load check left for after the load (its flash attention trial), once the engine
        exists: `done` (the engine's machine_changed) is called when it ends, so the thread counts tuned beside it
        are tried again, as after the target's own trial."""
        check, self._draft_check = self._draft_check, None
        if check is not None:
            check.loaded(done)

    def draft_row(self) -> DraftProcess | None:
        """The draft model as `ps` shows it, if one is loaded."""
        d = self.draft_model
        if d is None:
            return None
        size = d.model.meta.size_bytes
        return DraftProcess(model=d.name, size=size, kv_cells=d.model.n_seq * d.n_ctx, threads=d.threads)

    @property
    def kind(self) -> str:
        """The drafter `auto` picks (what `localllm ps` shows)."""
        return next(k for k in ("mtp", "draft", "ngram") if k in self._builders)

    def drafter_for(self, opts: SamplingOptions, *, grammar: str | None, n_prompt: int) -> Drafter | None:
        """A new request's drafter (None: it does not speculate); InvalidInput when its spec_type is not offered."""
        kind = self.kind if opts.spec_type == "auto" else opts.spec_type
        if kind == "none" or opts.spec_max_draft == 0:
            return None
        builder = self._builders.get(kind)
        if builder is None:
            raise InvalidInput(
                f"spec_type {kind!r} is not available for this model",
                hint=_MISSING_HINT[kind] + f"; it offers {', '.join(sorted(self._builders))}",
            )
        drafter = builder(self._window(opts.spec_max_draft, self.cost, floor=opts.spec_min_draft))
        grammars = self.target.grammars
        probe = grammars.probe(grammar) if grammar and grammars is not None else None
        return drafter if probe is None else GrammarCheckedDrafter(drafter, probe, n_prompt=n_prompt)

    def may_draft(self, busy_slots: int, depth: int) -> bool:
        """Before a step whose deepest generating request is at `depth`: is it worth asking the drafters at all?
        (No: they are skipped.) It also sets the depth band the drafters size their drafts by. The answer for a
        batch size and band is kept for GATE_STEPS steps: the step cost moves slowly."""
        cost = self.cost.at(depth)
        if self.cost.learnt_elsewhere() or cost.drafts_lose(busy_slots):
            return False  # a plain step first: it prices a row at this depth, or counts down the losing drafts' rest
        key = (busy_slots, DepthCosts.band(depth))
        steps, answer = self._gate.get(key, (-1, False))
        if steps < 0 or self._steps - steps >= GATE_STEPS:
            answer = self._window.any_draft_pays(cost, busy_slots)
            self._gate[key] = (self._steps, answer)
        return answer

    def observe(self, batch: Batch, copies: Sequence[tuple[int, int, int]]) -> None:
        """After every target decode, before sampling: the MTP head follows the batch."""
        if self.mtp is not None:
            self.mtp.observe(batch, copies)

    def record_step(self, batch: Batch, seconds: float, *, busy: int, emitted: int, drafted: bool) -> None:
        """After sampling: what the step cost on the model's step clock (decode, MTP follow-up and sampling), for
        the draft window, and what it yielded: `emitted` tokens for `busy` generating requests, with drafts or
        without."""
        if batch and sum(batch.logits) == len(batch):  # a decode step: prefill rows run other kernels, yield nothing
            depth = max(batch.positions)
            self.cost.record(len(batch), len(batch), seconds, depth=depth)
            self.cost.record_outcome(busy, depth=depth, drafted=drafted, tokens=emitted, seconds=seconds)
        elif batch:
            self.cost.observe_prompt(len(batch), seconds)
        self._steps += 1

    def close(self) -> None:
        """When the model unloads: free the draft contexts."""
        if self.mtp is not None:
            self.mtp.close()
            self.mtp = None
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None


def load_speculation(store: Store, model: ResolvedModel, load: LoadOptions, loaded: LoadedModel) -> Speculation:
    """The pool's drafter factory: called once per model load, on the loading thread, before the engine starts."""
    draft = None
    if load.draft:
        from ...backends import choose_backend, get_backend, load_check_memory

        weights = store.resolve(load.draft).weights
        # A draft that would abort llama.cpp fails this load alone; it gets its own flash attention finding.
        backend = get_backend(choose_backend(load.backend, weights))
        checked = backend.check(weights, load, memory=load_check_memory(store.root))
        draft = open_draft_model(weights, checked.applied_to(load), loaded, name=load.draft)
        return Speculation(loaded, draft=draft, mtp=open_mtp_head(loaded), draft_check=checked)
    return Speculation(loaded, mtp=open_mtp_head(loaded))


def open_mtp_head(loaded: LoadedModel) -> MtpHead | None:
    """The model's MTP head when its weights carry one and the backend runs it, else None."""
    if loaded.mtp is None:
        return None
    try:
        return loaded.mtp.open_head()
    except LocalLLMError as exc:  # e.g. nextn layers this llama.cpp cannot run as a head: speculate without them
        log.warning("MTP head unavailable: %s", exc)
        return None


def open_draft_model(weights: Path, load: LoadOptions, target: LoadedModel, *, name: str) -> DraftModel:
    """Load a draft model beside `target` (same slots and context per slot), checking it shares the vocabulary."""
    from ...backends import choose_backend, get_backend

    threads = load.num_thread or physical_cores()  # fixed: the thread tuner follows the model's own steps
    update = {"draft": None, "num_parallel": target.n_seq, "num_ctx": target.n_ctx, "num_thread": threads}
    model = get_backend(choose_backend(load.backend, weights)).load(weights, load.model_copy(update=update))
    try:
        check_same_vocab(target, model, draft_name=name)
    except BaseException:
        model.close()
        raise
    log.info("draft model %s loaded beside the model: %d slots x %d tokens", name, model.n_seq, model.n_ctx)
    draft = DraftModel(model, name=name, n_vocab=target.meta.n_vocab, threads=threads)
    try:
        draft.price()  # before the engine thread takes it over: no request waits for it
    except BaseException:
        draft.close()
        raise
    return draft
