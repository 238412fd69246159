"""A loaded MLX model: decode, the sequences' caches, the embedder part.

Each slot owns its own per-layer KV cache, so trimming (prefix reuse, speculative rewind) and prefix copies are cache
operations on one sequence. A batch that mixes sequences runs each sequence's rows as one forward pass over that
sequence's cache, one sequence after another."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ...api import SamplingOptions
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
from .meta import make_piece_decoder, read_meta
from .sampling import GRAMMAR_UNSUPPORTED, MlxSampler

# ------------------------------------------------------------------------------------------------------- the model


class MlxModel:
    """A loaded MLX model: weights, tokenizer and one KV cache per sequence. Its one optional part is an embedder,
    for architectures whose inner model gives hidden states."""

    n_batch = 512  # prefill chunk: the scheduler's token budget per step
    kv_pad = 1  # attention spans the cache exactly (no padded grid as in llama.cpp)
    placement: Placement | None = None  # MLX runs the whole model on its one device
    # What MLX does not do here. No projectors (load refuses them). mlx-lm loads language models only, so there is no
    # cross-encoder's classifier head. No sequence states yet: an evicted prefix is prefilled again. No MTP layers:
    # spec_type auto falls back to a draft model or n-gram. Sampling takes no grammars. MLX schedules its own
    # threads: the engine's thread tuner leaves it alone.
    vision: Vision | None = None
    reranker: Reranker | None = None
    states: SequenceStates | None = None
    mtp: MtpLayers | None = None
    grammars: GrammarChecks | None = None
    threads: ThreadControl | None = None

    def __init__(self, path: Path, model, tokenizer, config: dict, *, n_seq: int, n_ctx: int):
        self.path = path
        self.weights: Hashable = ("mlx", id(self))  # every MLX load holds its own copy of the weights
        self._model = model
        self._hf = tokenizer._tokenizer
        self._backend_tok = self._hf.backend_tokenizer
        self.meta = read_meta(path, model, tokenizer, config)
        self.n_seq = n_seq
        self.n_ctx = n_ctx
        self.kv_cells = n_seq * n_ctx  # each sequence's cache is its own
        self._n_layers = len(model.layers)
        self._caches: list[list[KVCache]] = [self._new_cache() for _ in range(n_seq)]
        self._outputs: dict[int, mx.array] = {}  # batch row -> logits [n_vocab] of the last decode
        self._eog = {int(t) for t in tokenizer.eos_token_ids}
        self._special = {i for i, tok in self._backend_tok.get_added_tokens_decoder().items() if tok.special}
        self._piece_bytes = make_piece_decoder(self._backend_tok)
        self._bytes_cache: dict[int, bytes] = {}
        inner = getattr(model, "model", None)  # the trunk without the output head (mlx-lm's model classes)
        self.embedder = MlxEmbedder(inner, n_ctx) if callable(inner) else None

    def _new_cache(self) -> list[KVCache]:
        # Plain caches for every layer, sliding-window ones included: the model still masks to its window, and a
        # cache that keeps every position can be trimmed and copied at any length (a rotating one cannot).
        return [KVCache() for _ in range(self._n_layers)]

    def cached_tokens(self, seq: int) -> int:
        """How many positions sequence `seq` holds."""
        return self._caches[seq][0].offset

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
        if token in self._backend_tok.get_added_tokens_decoder():
            return text.encode()
        return self._piece_bytes(text)

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    # ----------------------------------------------------------------------------------------------- compute

    def decode(self, batch: Batch) -> None:
        self._outputs = {}
        rows_by_seq = self._group_rows(batch)
        try:
            for seq, rows in rows_by_seq.items():
                self._forward(seq, rows, batch)
            mx.eval(list(self._outputs.values()), [self._cache_state(seq) for seq in rows_by_seq])
        except (RuntimeError, ValueError) as exc:
            raise LocalLLMError(f"MLX decode failed on a batch of {len(batch)} tokens: {exc}") from None

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

    def _forward(self, seq: int, rows: list[int], batch: Batch) -> None:
        """One forward pass of `seq`'s rows; logits are kept only for rows that asked for them."""
        cache = self._caches[seq]
        tokens = [batch.tokens[r] for r in rows]
        wanted = [i for i, r in enumerate(rows) if batch.logits[r]]
        # Rows before the first wanted one only fill the cache: their output head is never built, because MLX
        # evaluates lazily and nothing reads those logits (saves the vocab projection on long prefills).
        first = wanted[0] if wanted else len(rows)
        if first:
            self._model(mx.array([tokens[:first]]), cache=cache)
        if not wanted:
            return
        logits = self._model(mx.array([tokens[first:]]), cache=cache)[0]  # [n_rows - first, n_vocab]
        picked = logits[mx.array([i - first for i in wanted])].astype(mx.float32)
        for k, i in enumerate(wanted):
            self._outputs[rows[i]] = picked[k]

    def _cache_state(self, seq: int) -> list:
        return [(c.keys, c.values) for c in self._caches[seq] if c.keys is not None]

    def row_logits(self, row: int) -> mx.array:
        """Logits of `row` of the last decode, as an MLX array [n_vocab] (samplers stay on the device)."""
        out = self._outputs.get(row)
        if out is None:
            raise LocalLLMError(f"no logits for batch row {row}: it was not marked for output in the last decode")
        return out

    def logits(self, row: int) -> np.ndarray:
        return np.array(self.row_logits(row), dtype=np.float32)

    def make_sampler(self, options: SamplingOptions, *, grammar: str | None = None) -> MlxSampler:
        if grammar is not None:
            raise InvalidInput(GRAMMAR_UNSUPPORTED, hint="use a GGUF model on llama.cpp for format / response_format")
        return MlxSampler(self, options)

    # ----------------------------------------------------------------------------------------------- cache

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        held = self.cached_tokens(seq)
        start = max(start, 0)
        if 0 <= end < held and end > start:
            raise InvalidInput(f"the MLX backend can only drop the end of a sequence, not positions {start}..{end}")
        if start == 0:
            self._caches[seq] = self._new_cache()  # frees the buffers instead of keeping them for reuse
        elif start < held:
            for layer in self._caches[seq]:
                layer.trim(held - start)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if src == dst:
            self.remove(dst, n)
            return
        n = max(0, min(n, self.cached_tokens(src)))
        fresh = self._new_cache()
        for source, target in zip(cast(list[Any], self._caches[src]), fresh):
            if n:
                # Real copies, so the source's later in-place cache writes never show up in the destination.
                target.keys = mx.contiguous(source.keys[..., :n, :])
                target.values = mx.contiguous(source.values[..., :n, :])
                target.offset = n
        self._caches[dst] = fresh
        mx.eval(self._cache_state(dst))

    def cache_shape(self) -> CacheShape:
        return CacheShape()  # every layer keeps a full cache here (see _new_cache): any cut is exact

    def close(self) -> None:
        self._caches = []
        self._outputs = {}
        self._model = None
        self.embedder = None


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
