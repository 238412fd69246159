"""Grammars on MLX: llama.cpp's GBNF (chat/schema_grammar.py, chat/call_formats.py) held by llguidance's matcher.

The semantics are llama.cpp's grammar sampler's. A plain grammar constrains from the first token. A lazy one leaves
the answer free until a trigger: a trigger token sampled, or a pattern that matches the answer so far (its bytes, as
llama.cpp's std::regex reads them). The grammar is then fed the text from the match's start (its first non-empty
group) and constrains from the next token. End of generation is allowed only where the grammar can end.

llguidance reads each token as bytes, given here as llama.cpp's grammar reads them: added tokens such as Qwen's
`<tool_call>` are their text. Control tokens are special to llguidance (no GBNF text matches one); where one is fed
(a trigger token, a generated token) its spelling is fed as text, as llama.cpp does. Where the grammar forces a run
of bytes, llguidance offers the tokens the tokenizer spells them with (llama.cpp: any tokens that spell them): the
texts allowed are the same."""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ...api import GrammarTriggers
from ...chat.call_formats import word_pattern
from ...errors import InvalidInput

if TYPE_CHECKING:
    import llguidance

    from ..base import LoadedModel

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'localllm[mlx]'"
GRAMMAR_INVALID = "the grammar (from format / response_format / tools) does not parse"


def grammars_installed() -> bool:
    """Whether llguidance, the matcher MLX grammars need, is installed (not imported until a grammar comes)."""
    return importlib.util.find_spec("llguidance") is not None


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InvalidInput(
            "structured output on the MLX backend needs llguidance, which is not installed", hint=INSTALL_HINT
        ) from None
    return llguidance


@functools.lru_cache(maxsize=16)
def _compiled(grammar: str) -> str:
    """GBNF text as llguidance's grammar (converted through Lark); a request's probe compiles the same text again."""
    llg = _llguidance()
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        lark = gbnf_to_lark(grammar)
    except Exception as exc:  # the converter raises plain Exceptions for unknown rules as well as its own errors
        raise InvalidInput(f"{GRAMMAR_INVALID}: {exc}") from None
    return llg.LLMatcher.grammar_from_lark(lark)


# ------------------------------------------------------------------------------------------------------- vocabulary


class GrammarVocab:
    """A load's vocabulary as llguidance reads it, built once per load (a pass over every token)."""

    def __init__(self, model: LoadedModel):
        llg = _llguidance()
        self.n_vocab = model.meta.n_vocab
        self.eog = frozenset(t for t in range(self.n_vocab) if model.is_eog(t))
        self.pieces, self.spelt = _pieces(model, self.n_vocab)
        self._tokenize = model.tokenize
        wrapper = llg.TokenizerWrapper(_VocabSource(self, model.meta.bos_token, model.meta.eos_token))
        self.tokenizer = llg.LLTokenizer(wrapper, n_vocab=self.n_vocab, eos_token=sorted(self.eog) or None)
        # Built from data, not as a lazy op: a lazy array belongs to its thread's stream, and the engine thread that
        # samples need not be the one that built the vocabulary.
        self._shifts = mx.array(np.arange(32, dtype=np.uint32))

    def text_tokens(self, text: str) -> list[int]:
        """Plain text as tokens: control tokens' spellings are characters, never the control token."""
        if not isinstance(text, str):  # llguidance asks once whether bytes are taken: they are not
            raise TypeError("text only")
        return self._tokenize(text, add_special=False, parse_special=False)

    def piece(self, token: int) -> bytes:
        """A token's bytes as llama.cpp's grammar reads them (a control token's spelling)."""
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def trigger_token(self, word: str) -> int | None:
        """The one token that spells `word`, where the vocabulary holds it whole (llama.cpp's trigger tokens)."""
        spelt = self._tokenize(word, add_special=False, parse_special=True)
        return spelt[0] if len(spelt) == 1 else None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        llg = _llguidance()
        matcher = llg.LLMatcher(self.tokenizer, _compiled(grammar), log_level=0)
        if matcher.is_error():  # a rule llguidance cannot build, or past its size limits
            raise InvalidInput(f"the grammar (from format / response_format / tools) is refused: {matcher.get_error()}")
        return matcher

    def feed(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        """Advance `matcher` by a generated token (end of generation ends it: nothing to feed); False where the
        grammar rejects it."""
        if token in self.eog:
            return True
        spelling = self.spelt.get(token)
        if spelling is not None:  # a control token reads as its spelling, as in llama.cpp's grammar
            return self.feed_text(matcher, spelling)
        return matcher.consume_token(token)

    def feed_text(self, matcher: llguidance.LLMatcher, text: bytes) -> bool:
        """Advance `matcher` by `text` however it is tokenized (llguidance matches bytes); False where rejected."""
        tokens = self.tokenizer.tokenize_bytes(text)
        if self.tokenizer.decode_bytes(tokens) != text:  # a sentencepiece encoder may add a leading space
            tokens = self.tokenizer.greedy_tokenize(text.decode("utf-8", "replace"))
        return matcher.consume_tokens(tokens)

    def allowed(self, matcher: llguidance.LLMatcher) -> mx.array:
        """The tokens the grammar allows next, as an MLX bool array [n_vocab]."""
        words = mx.array(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32))
        bits = (words[:, None] >> self._shifts) & 1  # token 32 * i + j is bit j of word i
        return bits.reshape(-1)[: self.n_vocab].astype(mx.bool_)


def _pieces(model: LoadedModel, n_vocab: int) -> tuple[list[bytes], dict[int, bytes]]:
    """Every token's bytes, and the spellings of the control tokens (which stream as nothing)."""
    pieces: list[bytes] = []
    spelt: dict[int, bytes] = {}
    for token in range(n_vocab):
        try:
            piece = model.token_bytes(token)
            if not piece:
                spelling = model.token_text(token).encode()
                if spelling:
                    piece = spelt[token] = spelling
        except InvalidInput:  # ids past the tokenizer's (an embedding padded to a round size) are no token
            piece = b""
        pieces.append(piece)
    return pieces, spelt


class _VocabSource:
    """What llguidance's TokenizerWrapper reads: token bytes, the special ids and a text encoder."""

    def __init__(self, vocab: GrammarVocab, bos: int | None, eos: int | None):
        self.tokens = vocab.pieces
        self.special_token_ids = sorted(vocab.spelt)
        self.bos_token_id = bos
        self.eos_token_id = eos if eos is not None else min(vocab.eog, default=0)
        self._vocab = vocab

    def __call__(self, text: str) -> list[int]:
        return self._vocab.text_tokens(text)


# ------------------------------------------------------------------------------------------------------- triggers


@dataclass(frozen=True)
class CompiledTriggers:
    tokens: frozenset[int]
    patterns: tuple[re.Pattern[bytes], ...]


def compile_triggers(triggers: GrammarTriggers, vocab: GrammarVocab) -> CompiledTriggers:
    """Trigger words the vocabulary holds as one token trigger as that token; the others become end-anchored
    patterns (as the llama.cpp backend builds them)."""
    tokens: set[int] = set()
    patterns = list(triggers.patterns)
    for word in triggers.words:
        token = vocab.trigger_token(word)
        if token is None:
            patterns.append(word_pattern(word))
        else:
            tokens.add(token)
    return CompiledTriggers(frozenset(tokens), tuple(_bytes_pattern(p) for p in patterns))


def _bytes_pattern(pattern: str) -> re.Pattern[bytes]:
    """`pattern` over bytes, its final `$` the end of the text only (ECMAScript's; Python's also matches before a
    final newline)."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    try:
        return re.compile(pattern.encode())
    except re.error as exc:
        raise InvalidInput(f"a tool call trigger pattern does not compile: {exc}") from None


def trigger_start(pattern: re.Pattern[bytes], text: bytes) -> int | None:
    """Where the grammar begins if `pattern` matches `text`: its first non-empty group's start, else the match's."""
    match = pattern.search(text)
    if match is None:
        return None
    for group in range(1, (pattern.groups or 0) + 1):
        start, end = match.span(group)
        if end > start:
            return start
    return match.start()


class _Awaiting:
    """A lazy grammar's wait: the answer so far (as llama.cpp's grammar reads it), checked after each token."""

    def __init__(self, triggers: CompiledTriggers):
        self.triggers = triggers
        self.text = bytearray()

    def matched(self, piece: bytes) -> bytes | None:
        """After a token of bytes `piece`: the text the grammar begins with, where a pattern now matches."""
        self.text += piece
        text = bytes(self.text)
        for pattern in self.triggers.patterns:
            start = trigger_start(pattern, text)
            if start is not None:
                return text[start:]
        return None


# ------------------------------------------------------------------------------------------------------- samplers


class GrammarConstraint:
    """One request's grammar in its sampler: the mask on each row's logits, and the matcher advanced by each token
    sampled (never by prompt tokens: llama.cpp's sampler feeds those to its penalties only)."""

    def __init__(self, vocab: GrammarVocab, grammar: str, triggers: GrammarTriggers | None):
        self._vocab = vocab
        self._matcher = vocab.matcher(grammar)
        self._awaiting = None if triggers is None else _Awaiting(compile_triggers(triggers, vocab))
        self._dropped = False

    def constrain(self, logits: mx.array) -> mx.array:
        """`logits` with the tokens the grammar forbids at -inf (unchanged while a lazy grammar waits)."""
        if self._awaiting is not None or self._dropped:
            return logits
        return mx.where(self._vocab.allowed(self._matcher), logits, -mx.inf)

    def advance(self, token: int) -> bool:
        """Feed a sampled token; False where the grammar rejects it, which a draw from constrained logits does only
        where nothing was left to draw (the grammar complete and its end banned by ignore_eos, every allowed token
        biased away, or the matcher failed)."""
        if self._awaiting is not None:
            self._await(self._awaiting, token)
            return True
        if self._dropped or self._vocab.feed(self._matcher, token):
            return True
        log.warning("the grammar allowed no token here (%s): the answer ends", self._matcher.get_error() or "none")
        return False

    def _await(self, awaiting: _Awaiting, token: int) -> None:
        if token in awaiting.triggers.tokens:
            fed = self._vocab.feed(self._matcher, token)
        else:
            text = awaiting.matched(self._vocab.piece(token))
            if text is None:
                return
            fed = self._vocab.feed_text(self._matcher, text)
        self._awaiting = None
        if not fed:  # call_formats.py's patterns match only prefixes of their grammar: a bug, not the request's
            log.warning("a tool call trigger matched text its grammar rejects; the answer stays free")
            self._dropped = True


class MlxGrammarProbe:
    """A copy of a request's grammar, advanced by the tokens the request has generated, that tells how much of a
    draft the grammar allows."""

    def __init__(self, vocab: GrammarVocab, grammar: str):
        self._vocab = vocab
        self._matcher = vocab.matcher(grammar)
        self._seen = 0

    def allowed(self, generated: Sequence[int], draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` the grammar accepts after `generated`; an end-of-generation token
        ends the draft (the target stops there anyway). A grammar that failed allows none."""
        for token in generated[self._seen :]:
            self._vocab.feed(self._matcher, token)
        self._seen = len(generated)
        end = next((i for i, token in enumerate(draft) if token in self._vocab.eog), len(draft))
        return self._matcher.validate_tokens(list(draft[:end])) if end else 0

    def close(self) -> None:
        pass


class MlxGrammars:
    """The GrammarChecks part of an MLX load, and the grammars of its samplers; the vocabulary is read on first use."""

    def __init__(self, model: LoadedModel):
        self._model = model
        self._vocab: GrammarVocab | None = None

    @property
    def vocab(self) -> GrammarVocab:
        if self._vocab is None:
            self._vocab = GrammarVocab(self._model)
        return self._vocab

    def constraint(self, grammar: str, triggers: GrammarTriggers | None = None) -> GrammarConstraint:
        return GrammarConstraint(self.vocab, grammar, triggers)

    def probe(self, grammar: str) -> MlxGrammarProbe:
        return MlxGrammarProbe(self.vocab, grammar)
