"""Pooled embeddings on llama.cpp: a context in embeddings mode beside a model's generation context, over the same
weights. Inputs are packed into as few decodes as fit (one sequence each, sharing one pool of cells), pooled the way
the model's GGUF says (`<arch>.pooling_type`: mean for nomic-bert, CLS or last for others; mean for a generative
model, which has none), and scaled to unit length, as Ollama returns them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import llama_cpp
import numpy as np

from ...errors import InvalidInput, LocalLLMError

MAX_SEQS = 64  # inputs one decode packs at most (llama.cpp allows up to 256 sequences in a context)


# Runs a native call: directly, or through the RPC guard of a load with layers on workers (which gives up when a
# worker is lost).
NativeCall = Callable[..., Any]


def pooling_for(gguf_pooling: int | None) -> int:
    """The pooling a context is created with: the model's own, or mean pooling for a model that names none (a
    reranker's rank pooling scores pairs instead: it has no Embedder)."""
    if gguf_pooling is None or gguf_pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return gguf_pooling


class LlamaEmbedder:
    """The Embedder part of a llama.cpp load that is not a reranker: inputs packed into decodes of the pooled
    context beside the generation context (`context` makes it at first use)."""

    def __init__(self, context: Callable[[], Any], *, n_ctx: int, n_embd: int, call: NativeCall):
        self._context, self._call = context, call
        self._n_ctx, self._n_embd = n_ctx, n_embd

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        return self._call(self._embed, inputs)

    def _embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        for i, tokens in enumerate(inputs):
            if not 0 < len(tokens) <= self._n_ctx:
                raise InvalidInput(f"input {i} is {len(tokens)} tokens; the embedding context holds 1 to {self._n_ctx}")
        ctx = self._context()
        vectors: list[list[float]] = []
        for run in pack(inputs, pack_limit(self._n_ctx, self._n_embd)):
            vectors += embed_group(ctx, [inputs[i] for i in run], self._n_embd)
        return vectors


def pack_limit(n_ctx: int, n_embd: int) -> int:
    """The tokens one packed decode may hold. Every token of a decode attends over every cell of it, masked by
    sequence, so packing costs each token ~4 x cells x n_embd flops beside ~24 x n_embd^2 in its matrix products: up to
    2 x n_embd cells keep that waste near a third. A real encoder (n_embd 768 and up) packs a whole context; a small
    one is otherwise bound by the masked attention (docs/benchmark-notes.md, reranking)."""
    return max(1, min(n_ctx, 2 * n_embd))


def pack(inputs: Sequence[Sequence[int]], n_ctx: int, max_seqs: int = MAX_SEQS) -> Iterator[range]:
    """Consecutive runs of inputs (as index ranges) whose tokens together fit `n_ctx` cells, `max_seqs` at most."""
    start, used = 0, 0
    for i, tokens in enumerate(inputs):
        if i > start and (used + len(tokens) > n_ctx or i - start >= max_seqs):
            yield range(start, i)
            start, used = i, 0
        used += len(tokens)
    if start < len(inputs):
        yield range(start, len(inputs))


def decode_group(ctx, group: Sequence[Sequence[int]], what: str) -> None:
    """One decode of every token list in `group` (sequence i is list i), from an empty cache: the pooled output of
    each sequence is then read with llama_get_embeddings_seq."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    total = sum(map(len, group))
    batch = llama_cpp.llama_batch_init(total, 0, 1)
    try:
        row = 0
        for seq, tokens in enumerate(group):
            for pos, token in enumerate(tokens):
                batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, pos, 1
                batch.seq_id[row][0] = seq
                batch.logits[row] = True
                row += 1
        batch.n_tokens = total
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise LocalLLMError(f"{what} decode failed for {len(group)} inputs of {total} tokens")
    finally:
        llama_cpp.llama_batch_free(batch)


def pooled_output(ctx, seq: int, width: int) -> np.ndarray:
    """Sequence `seq`'s pooled output of the last decode: `width` floats (n_embd, or n_cls_out for a reranker)."""
    ptr = llama_cpp.llama_get_embeddings_seq(ctx, seq)
    if not ptr:
        raise LocalLLMError(f"llama.cpp returned no pooled output for input {seq}")
    return np.ctypeslib.as_array(ptr, shape=(width,)).astype(np.float64)


def embed_group(ctx, group: Sequence[Sequence[int]], n_embd: int) -> list[list[float]]:
    """One decode of every input in `group` (sequence i is input i), each pooled and normalised."""
    decode_group(ctx, group, "embedding")
    return [_unit(pooled_output(ctx, seq, n_embd)) for seq in range(len(group))]


def _unit(vector: np.ndarray) -> list[float]:
    norm = float(np.linalg.norm(vector)) or 1.0
    return (vector / norm).tolist()
