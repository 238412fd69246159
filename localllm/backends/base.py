"""The core Protocol every backend implements, and its optional parts. The engine thread is the only caller, so
implementations need no locks.

A loaded model holds one native context with `n_seq` sequences (one per slot), each able to hold `n_ctx` tokens.
Rows of a Batch are addressed by their index: `decode(batch)` computes outputs for rows marked `logits`, and
`Sampler.sample(row)` / `logits(row)` read the output of that row of the last decode.

`LoadedModel` is the core every load has: text, decode, sampling and the sequence cache. What only some loads can do
hangs off it as optional parts, each a small Protocol or None (`vision`, `embedder`, `reranker`, `states`, `mtp`,
`grammars`, `threads`): a caller asks `model.vision is None` instead of catching a stub's error, and a new capability
is a new part, not a method every backend must stub."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from ..api import GrammarTriggers, LoadOptions, LoraAdapter, SamplingOptions
from ..chat.fim import FimTokens
from ..media import ImagePixels, PromptImage
from ..models.info import RANK_POOLING
from ..models.plan import Placement


def greedy_pick(logits: np.ndarray) -> tuple[int, float]:
    """The most likely token and its probability."""
    token = int(np.argmax(logits))
    top = float(logits[token])
    return token, float(1.0 / np.exp(logits.astype(np.float64) - top).sum())


@dataclass(frozen=True)
class ModelMeta:
    """Facts about loaded weights, read from metadata, never from file names."""

    architecture: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    bos_token: int | None
    eos_token: int | None
    add_bos: bool
    chat_template: str | None
    n_params: int = 0
    size_bytes: int = 0
    has_mtp: bool = False
    description: str = ""
    fim: FimTokens | None = None  # the fill-in-the-middle tokens, where the vocabulary has all three
    pooling: int | None = None  # the GGUF's pooling type: set only in an embedding model, which generates nothing
    vision: bool = False  # loaded with a vision projector: prompts may hold images

    @property
    def embedding_only(self) -> bool:
        return self.pooling is not None

    @property
    def reranker(self) -> bool:
        """A cross-encoder: rank pooling through a classifier head, which scores pairs and embeds nothing."""
        return self.pooling == RANK_POOLING


@dataclass
class Batch:
    """Tokens to decode in one step, as parallel lists (cheap to build in the hot loop)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(self, token: int, pos: int, seq: int, want_logits: bool) -> int:
        """Append a row and return its index."""
        self.tokens.append(token)
        self.positions.append(pos)
        self.seqs.append(seq)
        self.logits.append(want_logits)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class CacheShape:
    """What a loaded model's sequence cache allows the prefix cache to do, and what its saved states depend on.

    A cache with sliding-window layers keeps only the last `window` positions of those layers in a saved state, and a
    recurrent state (Mamba, hybrids) holds every token it has read: such a state can be continued from its end but not
    cut shorter (engine/slots.py turns this into each slot's and entry's `floor`)."""

    window: int = 0  # span of the sliding-window layers; 0: every layer attends to the whole context
    recurrent: bool = False  # recurrent layers: no cut is ever possible, only continuing from the end
    fingerprint: str = ""  # the load's facts a saved state must match besides the weights (KV type, slots, build)

    def saved_floor(self, n_tokens: int) -> int:
        """The shortest prefix a state saved after `n_tokens` can be cut to and continued (0: any)."""
        if self.recurrent or (self.window and n_tokens > self.window):
            return n_tokens
        return 0


@dataclass(frozen=True)
class LoadCheck:
    """What a backend's check of weights before their load found on this machine, beyond "they load"."""

    flash_attn: bool | None = None  # the setting measured faster, where the load leaves it open; None: not settled
    # Work the check leaves until the weights have loaded (the flash attention trial's child), so that it never
    # competes with the load: the pool starts it after a successful load, and it calls its argument when it ends.
    then: Callable[[Callable[[], None] | None], None] | None = None

    def loaded(self, done: Callable[[], None] | None = None) -> None:
        """Begin what the check left for after a successful load; `done` is called (from another thread) once that
        work has ended, as the CPU it took is free again. Nothing left: nothing to call."""
        if self.then is not None:
            self.then(done)

    def applied_to(self, load: LoadOptions) -> LoadOptions:
        """`load` with what the check settled filled in."""
        return load if self.flash_attn is None else load.model_copy(update={"flash_attn": self.flash_attn})


class Sampler(Protocol):
    """A per-request sampling chain (temperature, top-k/p, min-p, penalties, seed, logit bias, grammar)."""

    def sample(self, row: int) -> int:
        """Pick a token from `row` of the last decode's outputs, and accept it into the chain's state."""

    def accept(self, token: int) -> None:
        """Feed a token the chain did not pick (prompt tokens, for penalties); grammars are not advanced."""

    def close(self) -> None: ...


class DraftSource(Protocol):
    """A cheap model that drafts tokens for one sequence at a time: a draft model's own context, or the target's MTP
    head. The drafting loop (engine/speculative/drafters.py) drives it; the engine thread is the only caller."""

    n_vocab: int  # ids the target knows: a draft stops at any other
    n_ctx: int
    seconds_per_token: float  # what drafting one token costs, on the engine's step clock (LoadedModel.step_clock)

    def begin(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        """Catch up with `tokens` (the request's prompt and output so far); the logits of the token after them."""

    def advance(self, seq: int, token: int, pos: int) -> np.ndarray:
        """Decode one drafted `token` at `pos`; the logits of the token after it."""

    def end(self, seq: int, n_tokens: int) -> None:
        """A draft that followed `n_tokens` tokens is complete (the source may drop what it decoded past them)."""

    def accept(self, seq: int, *, start: int, accepted: int) -> None:
        """After verification: of the draft that followed `start` tokens, the first `accepted` were kept."""

    def close(self) -> None: ...


class MtpHead(DraftSource, Protocol):
    """The target's own multi-token-prediction layers: it follows every target decode to stay in step."""

    def observe(self, batch: Batch, copies: Sequence[tuple[int, int, int]]) -> None:
        """After each target decode: `batch` was decoded, after the (src, dst, n) prefix `copies`."""


class GrammarProbe(Protocol):
    """A copy of a request's grammar that tells how much of a draft the grammar allows."""

    def allowed(self, generated: Sequence[int], draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` the grammar accepts after `generated`."""

    def close(self) -> None: ...


class Vision(Protocol):
    """Images in prompts, through a vision projector loaded beside the weights."""

    def image_tokens(self, image: ImagePixels) -> list[int]:
        """The prompt piece that stands for `image`: the text tokens the projector wraps it in and one placeholder
        per embedding position (a PromptImage's); tokenizing only, so any thread may ask. Raises InvalidInput for an
        image the projector cannot take."""

    def encode_image(self, image: PromptImage) -> None:
        """Compute the embeddings of `image` (engine thread, before a decode whose rows hold its placeholders); a
        batch row whose token is a placeholder then decodes that embedding. Cheap when they are still at hand."""


class Embedder(Protocol):
    """Pooled text embeddings (an embedding model's, or a generative model's mean-pooled hidden states)."""

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """A pooled, normalised embedding of each input (token lists of 1 to n_ctx tokens), decoded together where
        the backend can."""


class Reranker(Protocol):
    """A cross-encoder's relevance scores for query/document pairs (meta.reranker: rank pooling, a classifier head)."""

    def pair_tokens(self, query: str, document: str) -> list[int]:
        """The sequence the model scores for one query/document pair, its special tokens laid out as the model's
        family expects (tokenizing only: any thread may ask)."""

    def rerank(self, pairs: Sequence[Sequence[int]]) -> list[float]:
        """The relevance score of each pair from pair_tokens (1 to n_ctx tokens each), higher for a better match,
        decoded together where the backend can."""


class SequenceStates(Protocol):
    """A sequence's cache saved as bytes and loaded back (the prefix cache's RAM and disk tiers, prompt-cache files)."""

    def save_seq(self, seq: int) -> bytes | None:
        """Sequence `seq`'s whole cached state as bytes; None where the backend could not read it (the engine then
        re-prefills instead of restoring)."""

    def restore_seq(self, seq: int, data: bytes, n_tokens: int) -> None:
        """Replace sequence `seq`'s cache with a state from save_seq that holds positions up to `n_tokens`; raises
        LocalLLMError when it does not load or holds other positions (the sequence is then left empty)."""


class MtpLayers(Protocol):
    """The weights' multi-token-prediction layers, which draft for speculative decoding."""

    def open_head(self) -> MtpHead:
        """The layers in a context of their own; raises LocalLLMError where the backend cannot run them."""


class GrammarChecks(Protocol):
    """Grammar probes that check drafts against a request's grammar (backends whose samplers take grammars)."""

    def probe(self, grammar: str) -> GrammarProbe: ...


class ThreadControl(Protocol):
    """The CPU threads a backend decodes with, set by the engine's thread tuner (engine/threads.py)."""

    def set(self, n: int) -> None:
        """CPU threads for the next decodes."""


class LoadedModel(Protocol):
    """One load's core: tokens, decode, sampling and the sequences' cache. The optional parts below are None where
    this load (its backend, weights or projector) lacks the capability."""

    meta: ModelMeta
    n_seq: int
    n_ctx: int
    n_batch: int  # the most tokens one decode takes
    kv_pad: int  # the backend attends over its cache in spans of this many cells (1: exactly)
    # KV cells the sequences share (at least n_ctx); n_seq x n_ctx where each sequence has cells of its own.
    kv_cells: int
    weights: Hashable  # equal for loads that share one copy of the weights in memory
    placement: Placement | None  # where its layers went (CPU, GPUs, RPC workers); None where not placed

    @property
    def vision(self) -> Vision | None:
        """Set where the load has a vision projector (meta.vision)."""

    @property
    def embedder(self) -> Embedder | None:
        """Set where the model embeds texts (every model but a reranker on llama.cpp; some architectures on MLX)."""

    @property
    def reranker(self) -> Reranker | None:
        """Set for a cross-encoder (meta.reranker)."""

    @property
    def states(self) -> SequenceStates | None:
        """Set where sequence states can be saved (without it, an evicted prefix is prefilled again)."""

    @property
    def mtp(self) -> MtpLayers | None:
        """Set where the weights carry MTP layers and the backend runs them."""

    @property
    def grammars(self) -> GrammarChecks | None:
        """Set where the backend samples with grammars."""

    @property
    def threads(self) -> ThreadControl | None:
        """Set where the engine may change the decode threads (None: the backend schedules its own)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""

    def token_text(self, token: int) -> str:
        """The token's own text, special tokens included (for templates that write BOS/EOS themselves)."""

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""

    def decode(self, batch: Batch) -> None:
        """Run the model over `batch`; raises LocalLLMError when the native call fails. Placeholder rows (images,
        encoded first) come after every token row, and none asks for logits (engine/scheduler.py keeps both)."""

    def step_clock(self) -> float:
        """Seconds on the clock that steps and drafts are priced on (engine/speculative): the calling thread's CPU
        time where the decode runs on it and on helpers that keep pace with it, which other load on the machine
        does not inflate; wall time where the work runs on threads or a device of the backend's own, which the
        calling thread's CPU time does not see."""

    def logits(self, row: int) -> np.ndarray:
        """Raw logits of `row` of the last decode, shape [n_vocab]."""

    def make_sampler(
        self, options: SamplingOptions, *, grammar: str | None = None, triggers: GrammarTriggers | None = None
    ) -> Sampler:
        """A sampler for one request; with `triggers` its grammar waits for one of them (chat/call_formats.py)."""

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        """Forget cached tokens [start, end) of sequence `seq` (end -1: to the end)."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make sequence `dst` hold the first `n` cached tokens of `src` (dst is cleared first)."""

    def cache_shape(self) -> CacheShape:
        """How this model's sequence states may be cut, saved and restored (engine/prefix_cache.py)."""

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def check(
        self, path: Path, options: LoadOptions, *, memory: Path, adapters: Sequence[LoraAdapter] = ()
    ) -> LoadCheck:
        """Before a load: raise ModelFormatError for weights (or weights with `adapters` applied) that would bring the
        process down, and measure what `options` leave open. `memory` is a folder the backend may keep its findings
        in (once per file, not per load); a path that does not exist is the load's error to give."""

    def load(
        self,
        path: Path,
        options: LoadOptions,
        *,
        adapters: Sequence[LoraAdapter] = (),
        projector: Path | None = None,
    ) -> LoadedModel:
        """Load the weights at `path` (a split GGUF's first part) with `adapters` applied and, with `projector`,
        that vision projector beside them, in num_parallel sequences of num_ctx tokens (`options` have their
        defaults filled: models/options.context_size); a backend that cannot apply adapters or read images raises
        InvalidInput."""

    def placement(self, path: Path, options: LoadOptions) -> Placement | None:
        """Where load() would put the layers with these options, by the devices' free memory now."""
