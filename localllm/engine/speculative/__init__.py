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
from typing import TYPE_CHECKING, Callable, Optional

from ...api import LoadOptions
from ...errors import InvalidInput, LocalLLMError
from .drafters import (DraftModel, DraftModelDrafter, Drafter, GrammarCheckedDrafter, MtpDrafter, NgramDrafter,
                       check_same_vocab)
from .policy import DraftWindow, StepCost, any_draft_pays
from ..probe import LoadProbe

__all__ = ["Drafter", "DraftWindow", "Speculation", "StepCost", "load_speculation", "open_draft_model",
           "open_mtp_head"]

if TYPE_CHECKING:
    from pathlib import Path

    from ...backends.base import LoadedModel
    from ...models.store import ResolvedModel, Store
    from ..runner import GenerationParams
    from ..scheduler import Request, Step

log = logging.getLogger(__name__)


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
        from ...backends.llama_cpp_spec import GrammarProbe

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
        from ...backends import choose_backend

        weights = store.resolve(load.draft).weights
        # A draft that would abort llama.cpp fails this load alone.
        LoadProbe.for_store(store).check(weights, load, backend=choose_backend(load.backend, weights))
        draft = open_draft_model(weights, load, loaded, name=load.draft)
    return Speculation(loaded, draft=draft, mtp=open_mtp_head(loaded))


def open_mtp_head(loaded: "LoadedModel"):
    """The model's MTP head when its weights carry one (llama.cpp only), else None."""
    if not loaded.meta.has_mtp or not hasattr(loaded, "raw_handles"):
        return None
    from ...backends.llama_cpp_spec import MtpHead

    try:
        return MtpHead(loaded)  # type: ignore[arg-type]
    except LocalLLMError as exc:  # e.g. nextn layers this llama.cpp cannot run as a head: speculate without them
        log.warning("MTP head unavailable: %s", exc)
        return None


def open_draft_model(weights: "Path", load: LoadOptions, target: "LoadedModel", *, name: str) -> DraftModel:
    """Load a draft model beside `target` (same slots and context per slot), checking it shares the vocabulary."""
    from ...backends import choose_backend, get_backend

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
