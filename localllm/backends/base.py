"""The small Protocol every backend implements. The engine thread is the only caller, so implementations need no locks.

A loaded model holds one native context with `n_seq` sequences (one per slot), each able to hold `n_ctx` tokens.
Rows of a Batch are addressed by their index: `decode(batch)` computes outputs for rows marked `logits`, and
`Sampler.sample(row)` / `logits(row)` read the output of that row of the last decode."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Optional, Protocol, Sequence

import numpy as np

from ..api import LoadOptions, LoraAdapter, SamplingOptions


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
    bos_token: Optional[int]
    eos_token: Optional[int]
    add_bos: bool
    chat_template: Optional[str]
    n_params: int = 0
    size_bytes: int = 0
    has_mtp: bool = False
    description: str = ""


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


class Sampler(Protocol):
    """A per-request sampling chain (temperature, top-k/p, min-p, penalties, seed, logit bias, grammar)."""

    def sample(self, row: int) -> int:
        """Pick a token from `row` of the last decode's outputs, and accept it into the chain's state."""

    def accept(self, token: int) -> None:
        """Feed a token the chain did not pick (prompt tokens, for penalties); grammars are not advanced."""

    def close(self) -> None: ...


class LoadedModel(Protocol):
    meta: ModelMeta
    n_seq: int
    n_ctx: int
    weights: Hashable  # equal for loads that share one copy of the weights in memory

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""

    def decode(self, batch: Batch) -> None:
        """Run the model over `batch`; raises LocalLLMError when the native call fails."""

    def logits(self, row: int) -> np.ndarray:
        """Raw logits of `row` of the last decode, shape [n_vocab]."""

    def make_sampler(self, options: SamplingOptions, *, grammar: Optional[str] = None) -> Sampler: ...

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        """Forget cached tokens [start, end) of sequence `seq` (end -1: to the end)."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make sequence `dst` hold the first `n` cached tokens of `src` (dst is cleared first)."""

    def embed(self, tokens: Sequence[int]) -> list[float]:
        """A pooled, normalised embedding of `tokens`."""

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def load(self, path: Path, options: LoadOptions, *, n_seq: int, n_ctx: int,
             adapters: Sequence[LoraAdapter] = ()) -> LoadedModel:
        """Load the weights at `path` (a split GGUF's first part) with `adapters` applied; a backend that cannot
        apply adapters raises InvalidInput."""
