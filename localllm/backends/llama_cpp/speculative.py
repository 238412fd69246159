"""llama.cpp's parts of speculative decoding: the MTP head (a second context over the target's own weights that
drafts from its hidden states) and a grammar probe that checks draft tokens against a request's grammar.

MTP follows llama.cpp's common/speculative.cpp (draft-mtp): the target context outputs its pre-head hidden state h
for every batch row; the MTP context (LLAMA_CONTEXT_TYPE_MTP, one sequence per slot like the target) keeps its own KV
of the pairs (token at p+1, h at p). After each target decode the head decodes the same rows to stay in step; a draft
then chains the head on its own output: token and h in, next token and h out. The drafting loop
(engine/speculative/drafters.py) drives it on the engine thread, the only thread that touches either context."""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from ...errors import InvalidInput, LocalLLMError
from ..base import Batch


class LlamaMtpHead:
    """The target's MTP layers in their own llama.cpp context: one sequence per slot, mirroring the target's KV."""

    def __init__(self, model, ctx_tgt, params, *, n_seq: int, n_ctx: int, n_vocab: int):
        """`model` and `ctx_tgt`: the target's llama_model and context; `params`: context params like the target's."""
        self._model, self._ctx_tgt = model, ctx_tgt
        self.n_seq, self.n_ctx = n_seq, n_ctx
        params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        params.ctx_other = self._ctx_tgt
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise LocalLLMError(
                "llama.cpp could not create the MTP context for this model", hint="use spec_type ngram or draft"
            )
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_vocab = n_vocab
        self.n_embd = llama_cpp.llama_model_n_embd_out(self._model)
        # Target: h for every row (the head pairs each token with the previous row's h); head: only for outputs.
        llama_cpp_ext.llama_set_embeddings_nextn(self._ctx_tgt, True, False)
        llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, True, True)
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        self._pos = (llama_cpp.llama_pos * 4)()
        # h of each sequence's last decoded position, and the target's h for its rows in the last batch.
        self._pending = np.zeros((self.n_seq, self.n_embd), dtype=np.float32)
        self.seconds_per_token = 0.0  # what drafting one token costs, for the draft window
        self._h = np.zeros(self.n_embd, dtype=np.float32)  # the head's own h while it drafts
        self._verified: list[np.ndarray] = [np.zeros((0, self.n_embd), dtype=np.float32)] * self.n_seq

    # ----------------------------------------------------------------------------------------------- follow the target

    def observe(self, batch: Batch, copies: Sequence[tuple[int, int, int]]) -> None:
        """Decode the target's last batch through the head, so its KV holds every position the target's does."""
        if not batch.tokens:
            return
        for src, dst, n in copies:
            self._copy_prefix(src, dst, n)
        h_tgt = self._target_h(len(batch))
        first, last = _row_spans(batch.seqs)
        for seq, row in first.items():  # whatever the head held from here on is stale (rejected drafts, old requests)
            llama_cpp.llama_memory_seq_rm(self._mem, seq, batch.positions[row], -1)
        llama_cpp.llama_batch_ext_clear(self._batch)
        for row, (token, pos, seq) in enumerate(zip(batch.tokens, batch.positions, batch.seqs)):
            h = self._pending[seq] if first[seq] == row else h_tgt[row - 1]
            self._add(token, pos, seq, h, output=False)
        self._process(f"following a batch of {len(batch)} rows")
        for seq, row in first.items():
            self._verified[seq] = h_tgt[row : last[seq] + 1].copy()
            self._pending[seq] = h_tgt[last[seq]]

    def accept(self, seq: int, *, start: int, accepted: int) -> None:
        """After verification: keep the head's KV through the accepted drafts; the next token pairs with the h of
        the last accepted row. `start` is the token count the draft followed (its decode row sat at start - 1)."""
        llama_cpp.llama_memory_seq_rm(self._mem, seq, start + accepted, -1)
        rows = self._verified[seq]
        if accepted < len(rows):
            self._pending[seq] = rows[accepted]

    # ----------------------------------------------------------------------------------------------- draft primitives

    def begin(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        # The head chains on its own output: the last token with the target's h before it, then token and h out.
        self._h = self._pending[seq].copy()
        return self.advance(seq, tokens[-1], len(tokens) - 1)

    def advance(self, seq: int, token: int, pos: int) -> np.ndarray:
        llama_cpp.llama_batch_ext_clear(self._batch)
        self._add(token, pos, seq, self._h, output=True)
        t0 = time.thread_time()  # the same clock as the engine's step costs
        self._process("drafting")
        self.seconds_per_token += 0.2 * (time.thread_time() - t0 - self.seconds_per_token)
        self._h = self._head_h()
        return self._logits()

    def end(self, seq: int, n_tokens: int) -> None:
        # The draft region is refilled by observe() with the target's own h once the target has verified it.
        llama_cpp.llama_memory_seq_rm(self._mem, seq, n_tokens - 1, -1)

    # ----------------------------------------------------------------------------------------------- native helpers

    def _add(self, token: int, pos: int, seq: int, h: np.ndarray, *, output: bool) -> None:
        idx = llama_cpp.llama_batch_ext_add_token(self._batch, seq, token)
        if idx < 0:
            raise LocalLLMError(f"MTP batch refused token {token} (error {idx})")
        self._pos[0] = pos
        llama_cpp.llama_batch_ext_set_pos(self._batch, idx, self._pos)
        embd = llama_cpp.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
        if not llama_cpp.llama_batch_ext_set_embd_token(self._batch, idx, embd):  # copies the row
            raise LocalLLMError(f"MTP batch refused a hidden state of width {self.n_embd}")
        if output:
            llama_cpp.llama_batch_ext_set_output_logits(self._batch, idx, True)

    def _process(self, what: str) -> None:
        status = llama_cpp.llama_process(self._ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if status != 0:
            raise LocalLLMError(f"the MTP head failed with status {status} while {what}")

    def _target_h(self, n_rows: int) -> np.ndarray:
        ptr = llama_cpp_ext.llama_get_embeddings_nextn(self._ctx_tgt)
        if not ptr:
            raise LocalLLMError("the model produced no hidden states for its MTP head")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd))

    def _head_h(self) -> np.ndarray:
        ptr = llama_cpp_ext.llama_get_embeddings_nextn_ith(self._ctx, 0)
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def _logits(self) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, 0)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _copy_prefix(self, src: int, dst: int, n: int) -> None:
        # As in the target (separate KV streams per sequence): copy whole, then cut.
        llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, dst, n, -1)

    def close(self) -> None:
        if self._ctx is None:
            return
        llama_cpp_ext.llama_set_embeddings_nextn(self._ctx_tgt, False, False)
        llama_cpp.llama_batch_ext_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        self._ctx = self._batch = None


def _row_spans(seqs: Sequence[int]) -> tuple[dict[int, int], dict[int, int]]:
    """First and last batch row of each sequence (the scheduler keeps a sequence's rows together)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for row, seq in enumerate(seqs):
        first.setdefault(seq, row)
        last[seq] = row
    return first, last


class LlamaGrammarProbe:
    """A copy of a request's grammar, advanced by the tokens the request has generated, that tells how much of a
    draft the grammar allows (the request's own sampler keeps its state; the probe works on a clone)."""

    def __init__(self, model, grammar: str):
        """`model`: the target's llama_model."""
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._grammar = llama_cpp.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not self._grammar:
            raise InvalidInput("the grammar (from format / response_format / tools) does not parse")
        self._seen = 0
        self._cell = (llama_cpp.llama_token_data * 1)()
        self._cells = llama_cpp.llama_token_data_array(data=self._cell, size=1, selected=-1, sorted=False)

    def allowed(self, generated: Sequence[int], draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` the grammar accepts after `generated`; an end-of-generation token
        ends the draft (the target stops there anyway)."""
        for token in generated[self._seen :]:
            llama_cpp.llama_sampler_accept(self._grammar, token)
        self._seen = len(generated)
        probe = llama_cpp.llama_sampler_clone(self._grammar)
        try:
            for i, token in enumerate(draft):
                if llama_cpp.llama_vocab_is_eog(self._vocab, token) or not self._allows(probe, token):
                    return i
                llama_cpp.llama_sampler_accept(probe, token)
            return len(draft)
        finally:
            llama_cpp.llama_sampler_free(probe)

    def _allows(self, probe, token: int) -> bool:
        cell = self._cell[0]
        cell.id, cell.logit, cell.p = llama_cpp.llama_token(token), 0.0, 0.0
        self._cells.size, self._cells.selected = 1, -1
        llama_cpp.llama_sampler_apply(probe, ctypes.byref(self._cells))
        return not math.isinf(self._cell[0].logit)

    def close(self) -> None:
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None


class LlamaMtpLayers:
    """The MtpLayers part of a load whose weights carry nextn layers: each open_head is a new MTP context."""

    def __init__(self, model, ctx_tgt, params: Callable[[], Any], *, n_seq: int, n_ctx: int, n_vocab: int):
        """`params`: makes context params like the target's (open_head changes its copy)."""
        self._model, self._ctx_tgt, self._params = model, ctx_tgt, params
        self._n_seq, self._n_ctx, self._n_vocab = n_seq, n_ctx, n_vocab

    def open_head(self) -> LlamaMtpHead:
        return LlamaMtpHead(
            self._model, self._ctx_tgt, self._params(), n_seq=self._n_seq, n_ctx=self._n_ctx, n_vocab=self._n_vocab
        )


class LlamaGrammarChecks:
    """The GrammarChecks part of every llama.cpp load: probes over the target's vocabulary."""

    def __init__(self, model):
        """`model`: the target's llama_model."""
        self._model = model

    def probe(self, grammar: str) -> LlamaGrammarProbe:
        return LlamaGrammarProbe(self._model, grammar)
