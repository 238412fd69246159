"""Sequence states on llama.cpp: one sequence's KV cells (and recurrent state) as bytes, for the prefix cache."""

from __future__ import annotations

import ctypes

import llama_cpp

from ...errors import LocalLLMError


class LlamaSequenceStates:
    """The SequenceStates part of every llama.cpp load, over its generation context."""

    def __init__(self, ctx, mem):
        """`ctx`: the generation context; `mem`: its memory (llama_get_memory)."""
        self._ctx, self._mem = ctx, mem

    def save_seq(self, seq: int) -> bytes | None:
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq)
        return ctypes.string_at(buf, n) if n else None

    def restore_seq(self, seq: int, data: bytes, n_tokens: int) -> None:
        # llama.cpp only reads the state: it is passed where the bytes object holds it, not copied first (a copy of
        # a few MB that left RAM's cache took as long as the restore itself).
        view = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self._ctx, view, len(data), seq) == 0:
            self._clear(seq)
            raise LocalLLMError(f"llama.cpp could not load a saved state of {len(data):,} bytes into slot {seq}")
        # A state whose cells end elsewhere than its token list says would make the next decode fail (positions
        # must follow on): refuse it here, while the request can still prefill instead.
        last = llama_cpp.llama_memory_seq_pos_max(self._mem, seq)
        if last != n_tokens - 1:
            self._clear(seq)
            raise LocalLLMError(f"a saved state for {n_tokens:,} tokens holds positions up to {last} in slot {seq}")

    def _clear(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, seq, 0, -1)
