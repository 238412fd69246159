"""A loaded MLX model: decode, the sequences' caches, the embedder part.

The sequences share one batched KV cache (kv.py) whose rows are ragged, so trimming (prefix reuse, speculative rewind)
and prefix copies are operations on one row. A batch runs the short rows of all sequences (decode tokens, drafts to
verify) in one forward pass, padded to the same count; a long prefill chunk runs in a pass of its own, since padding
every other sequence to its length would multiply the work."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...api import GrammarTriggers, SamplingOptions
from ...errors import InvalidInput, LocalLLMError
from ...models.plan import Placement
from ..base import (
    Batch,
    CacheShape,
    GrammarChecks,
    MtpLayers,
    Reranker,
    SequenceStates,
    ThreadControl,
    Vision,
)
from .grammar import INSTALL_HINT, MlxGrammars, grammars_installed
from .kv import KvQuant, SlotCache
from .meta import make_piece_decoder, read_meta
from .sampling import GRAMMAR_UNSUPPORTED, MlxSampler
from .states import MlxStates

# ------------------------------------------------------------------------------------------------------- the model

# The most rows a sequence may have and still share a pass with the others: decode tokens and drafts to verify. Every
# sequence in the pass is padded to the longest, so a prefill chunk beside them would cost its length in every row.
MAX_PADDED_ROWS = 16


class MlxModel:
    """A loaded MLX model: weights, tokenizer and the sequences' batched KV cache. Its optional parts are sequence
    states (states.py) and an embedder, for architectures whose inner model gives hidden states."""

    n_batch = 512  # prefill chunk: the scheduler's token budget per step
    kv_pad = 1  # attention spans the cache exactly (no padded grid as in llama.cpp)
    placement: Placement | None = None  # MLX runs the whole model on its one device
    # What MLX does not do here. No projectors (load refuses them). mlx-lm loads language models only, so there is no
    # cross-encoder's classifier head. No MTP layers:
    # spec_type auto falls back to a draft model or n-gram. MLX schedules its own threads: the engine's thread tuner
    # leaves it alone.
    vision: Vision | None = None
    reranker: Reranker | None = None
    states: SequenceStates | None = None  # set per load (states.py), once its cache exists
    mtp: MtpLayers | None = None
    grammars: GrammarChecks | None = None  # set per load where llguidance (the mlx extra) is installed: grammar.py
    threads: ThreadControl | None = None

    def __init__(
        self, path: Path, model, tokenizer, config: dict, *, n_seq: int, n_ctx: int, kv_quant: KvQuant | None = None
    ):
        self.path = path
        self.weights: Hashable = ("mlx", id(self))  # every MLX load holds its own copy of the weights
        self._model = model
        self._hf = tokenizer._tokenizer
        self._backend_tok = self._hf.backend_tokenizer
        self.meta = read_meta(path, model, tokenizer, config)
        self.n_seq = n_seq
        self.n_ctx = n_ctx
        self.kv_cells = n_seq * n_ctx  # each sequence's cache is its own
        self._kv = SlotCache(len(model.layers), n_seq, quant=kv_quant)
        self.states = MlxStates(self._kv)
        self._outputs: dict[int, mx.array] = {}  # batch row -> logits [n_vocab] of the last decode
        self._eog = {int(t) for t in tokenizer.eos_token_ids}
        added = self._backend_tok.get_added_tokens_decoder()  # a new dict each call: read once
        self._special = {i for i, tok in added.items() if tok.special}
        self._added = frozenset(added)
        self._piece_bytes = make_piece_decoder(self._backend_tok)
        self._bytes_cache: dict[int, bytes] = {}
        inner = getattr(model, "model", None)  # the trunk without the output head (mlx-lm's model classes)
        self.embedder = MlxEmbedder(inner, n_ctx) if callable(inner) else None
        self._grammars = MlxGrammars(self) if grammars_installed() else None
        self.grammars = self._grammars

    def cached_tokens(self, seq: int) -> int:
        """How many positions sequence `seq` holds."""
        return self._kv.lengths[seq]

    # ----------------------------------------------------------------------------------------------- text

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        tok = self._backend_tok
        # encode_special_tokens=True makes "<|im_end|>" in user text plain characters instead of a control token.
        tok.encode_special_tokens = not parse_special
        try:
            return tok.encode(text, add_special_tokens=add_special).ids
        finally:
            tok.encode_special_tokens = False

    def token_bytes(self, token: int) -> bytes:
        piece = self._bytes_cache.get(token)
        if piece is None:
            piece = self._token_bytes(token)
            self._bytes_cache[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        if token in self._special:  # its own spelling, though it streams as nothing (token_bytes)
            return self._backend_tok.id_to_token(token) or ""
        return self.token_bytes(token).decode("utf-8", "replace")

    def _token_bytes(self, token: int) -> bytes:
        if token in self._special:
            return b""  # control tokens render as nothing, as llama.cpp's token_to_piece does
        text = self._backend_tok.id_to_token(token)
        if text is None:
            raise InvalidInput(f"token {token} is outside the vocabulary of {self.meta.n_vocab}")
        if token in self._added:
            return text.encode()
        return self._piece_bytes(text)

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    # ----------------------------------------------------------------------------------------------- compute

    def decode(self, batch: Batch) -> None:
        self._outputs = {}
        rows_by_seq = self._group_rows(batch)
        try:
            for seqs in _forward_groups(rows_by_seq):
                if len(seqs) == 1:
                    self._forward_one(seqs[0], rows_by_seq[seqs[0]], batch)
                else:
                    self._forward_many(seqs, rows_by_seq, batch)
                # Each pass's writes are evaluated before the next pass writes the same buffers, so MLX can write
                # them in place instead of copying a buffer another pass still reads.
                mx.eval(list(self._outputs.values()), self._kv.arrays())
        except (RuntimeError, ValueError) as exc:
            raise LocalLLMError(f"MLX decode failed on a batch of {len(batch)} tokens: {exc}") from None

    def step_clock(self) -> float:
        # MLX evaluates on its own stream threads (or the GPU): the calling thread only waits, whatever the rows.
        return time.perf_counter()

    def _group_rows(self, batch: Batch) -> dict[int, list[int]]:
        """Rows per sequence, checked to continue that sequence's cache position by position."""
        rows_by_seq: dict[int, list[int]] = {}
        for row, seq in enumerate(batch.seqs):
            if not 0 <= seq < self.n_seq:
                raise InvalidInput(f"batch row {row} names sequence {seq}; this model has {self.n_seq}")
            rows_by_seq.setdefault(seq, []).append(row)
        for seq, rows in rows_by_seq.items():
            start = self.cached_tokens(seq)
            positions = [batch.positions[r] for r in rows]
            if positions != list(range(start, start + len(rows))):
                raise LocalLLMError(
                    f"sequence {seq} holds {start} tokens but the batch gives positions "
                    f"{positions[0]}..{positions[-1]}; rows must continue the cache"
                )
            if start + len(rows) > self.n_ctx:
                raise LocalLLMError(
                    f"sequence {seq} would hold {start + len(rows)} tokens; its context is {self.n_ctx}",
                    hint="the KV cache is full: raise num_ctx",
                )
        return rows_by_seq

    def _forward_one(self, seq: int, rows: list[int], batch: Batch) -> None:
        """One sequence's rows in one pass; logits are kept only for rows that asked for them."""
        tokens = [batch.tokens[r] for r in rows]
        wanted = [i for i, r in enumerate(rows) if batch.logits[r]]
        # Rows before the first wanted one only fill the cache: their output head is never built, because MLX
        # evaluates lazily and nothing reads those logits (saves the vocab projection on long prefills).
        first = wanted[0] if wanted else len(rows)
        if first:
            self._run([seq], [tokens[:first]])
        if not wanted:
            return
        logits = self._run([seq], [tokens[first:]])[0]  # [n_rows - first, n_vocab]
        self._keep(logits, [(rows[i], i - first) for i in wanted])

    def _forward_many(self, seqs: list[int], rows_by_seq: dict[int, list[int]], batch: Batch) -> None:
        """Several sequences' rows in one pass, each padded to the longest; the padding is never kept."""
        logits = self._run(seqs, [[batch.tokens[r] for r in rows_by_seq[seq]] for seq in seqs])  # [B, L, n_vocab]
        n_rows = logits.shape[1]
        flat = logits.reshape(-1, logits.shape[-1])
        wanted = [(r, b * n_rows + i) for b, seq in enumerate(seqs) for i, r in enumerate(rows_by_seq[seq])]
        self._keep(flat, [(r, index) for r, index in wanted if batch.logits[r]])

    def _run(self, seqs: list[int], tokens: list[list[int]]) -> mx.array:
        """The model over `tokens` of each of `seqs` (right-padded to the same count); the logits [B, L, n_vocab]."""
        n_rows = max(len(t) for t in tokens)
        padded = [t + [t[-1]] * (n_rows - len(t)) for t in tokens]
        logits = self._model(mx.array(padded), cache=self._kv.step(seqs, n_rows))
        self._kv.advance(seqs, [len(t) for t in tokens])
        return logits

    def _keep(self, logits: mx.array, picks: list[tuple[int, int]]) -> None:
        """Keep logits[index] as batch row `row`'s output, for each (row, index), in float32."""
        if not picks:
            return
        picked = logits[mx.array([index for _, index in picks])].astype(mx.float32)
        for k, (row, _) in enumerate(picks):
            self._outputs[row] = picked[k]

    def row_logits(self, row: int) -> mx.array:
        """Logits of `row` of the last decode, as an MLX array [n_vocab] (samplers stay on the device)."""
        out = self._outputs.get(row)
        if out is None:
            raise LocalLLMError(f"no logits for batch row {row}: it was not marked for output in the last decode")
        return out

    def logits(self, row: int) -> np.ndarray:
        return np.array(self.row_logits(row), dtype=np.float32)

    def make_sampler(
        self, options: SamplingOptions, *, grammar: str | None = None, triggers: GrammarTriggers | None = None
    ) -> MlxSampler:
        constraint = None
        if grammar and self._grammars is not None:
            constraint = self._grammars.constraint(grammar, triggers)
        elif grammar and triggers is None:  # a lazy tool call grammar only helps: without it the answer is parsed
            raise InvalidInput(GRAMMAR_UNSUPPORTED, hint=INSTALL_HINT)
        return MlxSampler(
            self.row_logits, options, n_ctx=self.n_ctx, n_vocab=self.meta.n_vocab, eog=self._eog, grammar=constraint
        )

    # ----------------------------------------------------------------------------------------------- cache

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        held = self.cached_tokens(seq)
        start = max(start, 0)
        if 0 <= end < held and end > start:
            raise InvalidInput(f"the MLX backend can only drop the end of a sequence, not positions {start}..{end}")
        self._kv.trim(seq, start)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if src == dst:
            self.remove(dst, n)
            return
        self._kv.copy(src, dst, max(0, min(n, self.cached_tokens(src))))
        mx.eval(self._kv.arrays())

    def cache_shape(self) -> CacheShape:
        # Every layer keeps every position (kv.py), sliding-window ones too: any cut is exact. A saved state loads
        # into a load with the same layers and float type, which the MLX build and the device decide.
        fingerprint = (
            f"mlx {version('mlx')}; mlx-lm {version('mlx-lm')}; {mx.default_device()}; layers {len(self._kv.keys)}; "
            f"kv {_describe(self._kv.quant)}"
        )
        return CacheShape(fingerprint=fingerprint)

    def close(self) -> None:
        self._kv = SlotCache(0, 0)
        self._outputs = {}
        self._model = None
        self.embedder = None
        self.states = None


def _describe(quant: KvQuant | None) -> str:
    return "full" if quant is None else f"{quant.bits} bits in groups of {quant.group_size}"


def _forward_groups(rows_by_seq: dict[int, list[int]]) -> list[list[int]]:
    """The sequences of a batch grouped into forward passes: every sequence with a few rows together (padded to
    the longest), each longer one (a prefill chunk) alone."""
    short = sorted(seq for seq, rows in rows_by_seq.items() if len(rows) <= MAX_PADDED_ROWS)
    long = sorted(seq for seq in rows_by_seq if seq not in short)
    return ([short] if short else []) + [[seq] for seq in long]


class MlxEmbedder:
    """The Embedder part: the trunk's final hidden states (final norm applied), mean-pooled and normalised."""

    def __init__(self, trunk: Callable[[mx.array], mx.array], n_ctx: int):
        self._trunk, self._n_ctx = trunk, n_ctx

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        return [self._embed_one(tokens) for tokens in inputs]

    def _embed_one(self, tokens: Sequence[int]) -> list[float]:
        if not 0 < len(tokens) <= self._n_ctx:
            raise InvalidInput(f"input is {len(tokens)} tokens; embeddings take 1 to {self._n_ctx}")
        hidden = self._trunk(mx.array([list(tokens)]))[0].astype(mx.float32)  # [n_tokens, n_embd]
        pooled = hidden.mean(axis=0)
        norm = mx.maximum(mx.linalg.norm(pooled), 1e-12)
        return np.array(pooled / norm, dtype=np.float64).tolist()
