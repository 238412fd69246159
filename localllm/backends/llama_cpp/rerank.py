"""Reranking on llama.cpp: a cross-encoder (a GGUF with rank pooling and a classifier head, `cls.output`) reads a
query and a document as one sequence and scores how well they match. A pair is laid out as llama-server lays it out
(tools/server's format_prompt_rerank), so that scores agree with it: the model's own `rerank` template when the GGUF
has one, else [BOS] query [EOS] [SEP] document [EOS], each special token only where the vocabulary asks for it.
Pairs pack into decodes as embeddings do (embedding.pack); a pair's score is the classifier's first output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp

from ...chat.special_tokens import Spell, find_typed, tokenize_rendered
from ...errors import InvalidInput
from .embedding import NativeCall, decode_group, pack, pack_limit, pooled_output

Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special) -> token ids


@dataclass(frozen=True)
class PairLayout:
    """How one model's vocabulary joins a query and a document into one sequence."""

    template: str | None  # the GGUF's `rerank` template, with {query} and {document}; None: special tokens
    bos: int | None  # first of all, where the vocabulary adds a BOS
    eos: int | None  # after each text, where it adds an EOS (SEP stands in for a vocabulary without EOS)
    sep: int | None  # between query and document, where it adds a SEP


def pair_layout(model, vocab) -> PairLayout:
    """The layout of a loaded model's pairs, read from its vocabulary and templates."""
    template = llama_cpp.llama_model_chat_template(model, b"rerank")

    def token(tok: int, wanted: bool) -> int | None:
        return tok if wanted and tok >= 0 else None

    eos = llama_cpp.llama_vocab_eos(vocab)
    if eos < 0:
        eos = llama_cpp.llama_vocab_sep(vocab)
    return PairLayout(
        template=template.decode("utf-8", "replace") if template else None,
        bos=token(llama_cpp.llama_vocab_bos(vocab), bool(llama_cpp.llama_vocab_get_add_bos(vocab))),
        eos=token(eos, bool(llama_cpp.llama_vocab_get_add_eos(vocab))),
        sep=token(llama_cpp.llama_vocab_sep(vocab), bool(llama_cpp.llama_vocab_get_add_sep(vocab))),
    )


def pair_tokens(layout: PairLayout, tokenize: Tokenize, spell: Spell, query: str, document: str) -> list[int]:
    """The sequence a cross-encoder scores for (query, document). The texts' own special-token spellings stay text;
    a template's are parsed (llama-server parses both)."""
    if layout.template is not None:
        # Replaced one after the other, as llama-server does, so the scores stay comparable for any input; a text that
        # spells a control token has it hidden first (chat/special_tokens.py), and only such a text is cut apart.
        typed = find_typed([query, document], tokenize, spell)
        if typed is not None:
            query, document = typed.hide(query), typed.hide(document)
        prompt = layout.template.replace("{query}", query).replace("{document}", document)
        return tokenize_rendered(prompt, typed, tokenize, spell, add_special=False)

    def marks(*tokens: int | None) -> list[int]:
        return [t for t in tokens if t is not None]

    return (
        marks(layout.bos)
        + tokenize(query, False, False)
        + marks(layout.eos, layout.sep)
        + tokenize(document, False, False)
        + marks(layout.eos)
    )


def score_group(ctx, group: Sequence[Sequence[int]], n_cls_out: int) -> list[float]:
    """One decode of every pair in `group`; each pair's relevance is its classifier's first output, as llama-server
    reports it (a raw logit: no sigmoid)."""
    decode_group(ctx, group, "rerank")
    return [float(pooled_output(ctx, seq, n_cls_out)[0]) for seq in range(len(group))]


class LlamaReranker:
    """The Reranker part of a cross-encoder load: pairs packed into decodes of a rank-pooled context beside the
    generation context (`context` makes it at first use)."""

    def __init__(
        self,
        layout: PairLayout,
        tokenize: Tokenize,
        spell: Spell,
        context: Callable[[], Any],
        *,
        n_ctx: int,
        n_embd: int,
        n_cls_out: int,
        call: NativeCall,
    ):
        self._layout, self._tokenize, self._spell, self._context, self._call = layout, tokenize, spell, context, call
        self._n_ctx, self._n_embd, self._n_cls_out = n_ctx, n_embd, n_cls_out

    def pair_tokens(self, query: str, document: str) -> list[int]:
        return pair_tokens(self._layout, self._tokenize, self._spell, query, document)

    def rerank(self, pairs: Sequence[Sequence[int]]) -> list[float]:
        return self._call(self._rerank, pairs)

    def _rerank(self, pairs: Sequence[Sequence[int]]) -> list[float]:
        for i, tokens in enumerate(pairs):
            if not 0 < len(tokens) <= self._n_ctx:
                raise InvalidInput(f"pair {i} is {len(tokens)} tokens; the reranking context holds 1 to {self._n_ctx}")
        ctx = self._context()
        scores: list[float] = []
        for run in pack(pairs, pack_limit(self._n_ctx, self._n_embd)):
            scores += score_group(ctx, [pairs[i] for i in run], self._n_cls_out)
        return scores
