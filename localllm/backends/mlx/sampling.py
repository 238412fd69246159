"""Sampling on MLX: mlx-lm's logits processors and filters in llama.cpp's order, then a seeded draw."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import mlx.core as mx

from ...api import SamplingOptions

if TYPE_CHECKING:
    from .grammar import GrammarConstraint

GRAMMAR_UNSUPPORTED = "structured output (grammar / JSON schema) on the MLX backend needs llguidance, not installed"


# ------------------------------------------------------------------------------------------------------- sampling

LogitsFilter = Callable[[mx.array], mx.array]


def apply_typical(logprobs: mx.array, mass: float) -> mx.array:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to `mass`."""
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    probs = mx.exp(logprobs)
    entropy = -mx.sum(mx.where(probs > 0, probs * logprobs, 0.0), axis=-1, keepdims=True)
    order = mx.argsort(mx.abs(-logprobs - entropy), axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < mass  # always keeps the first
    keep = mx.put_along_axis(mx.zeros(keep_sorted.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, -mx.inf)


def make_filters(opts: SamplingOptions, n_vocab: int) -> list[LogitsFilter]:
    """The truncation steps in llama.cpp's order (top-k, typical, top-p, min-p), built once per request."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    filters: list[LogitsFilter] = []
    if 0 < opts.top_k < n_vocab:
        filters.append(lambda x: apply_top_k(x, opts.top_k))
    if opts.typical_p < 1.0:
        filters.append(lambda x: apply_typical(x, opts.typical_p))
    if opts.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, opts.top_p))
    if opts.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, opts.min_p))
    return filters


def make_processors(opts: SamplingOptions, *, n_ctx: int, eog: set[int]) -> list:
    """Logit bias (plus -inf on end-of-generation tokens for ignore_eos) and the repetition penalties."""
    from mlx_lm.sample_utils import make_logits_processors

    bias = {int(t): float(b) for t, b in opts.logit_bias.items()}
    if opts.ignore_eos:
        bias.update({t: -float("inf") for t in eog})
    last_n = n_ctx if opts.repeat_last_n == -1 else opts.repeat_last_n
    penalties = last_n > 0
    return make_logits_processors(
        logit_bias=bias or None,
        repetition_penalty=opts.repeat_penalty if penalties and opts.repeat_penalty != 1.0 else None,
        repetition_context_size=last_n,
        presence_penalty=opts.presence_penalty if penalties else None,
        presence_context_size=last_n,
        frequency_penalty=opts.frequency_penalty if penalties else None,
        frequency_context_size=last_n,
    )


class MlxSampler:
    """mlx-lm's processors, the grammar's mask, mlx-lm's filters, then a seeded draw; temperature 0 is greedy. The
    order is llama.cpp's chain: logit bias, penalties, grammar, then top-k, typical, top-p, min-p and temperature.

    The random key belongs to the sampler, not to MLX's global state, so a seeded request gives the same tokens
    whatever other slots sample in between."""

    def __init__(
        self,
        row_logits: Callable[[int], mx.array],
        opts: SamplingOptions,
        *,
        n_ctx: int,
        n_vocab: int,
        eog: set[int],
        grammar: GrammarConstraint | None = None,
    ):
        self._row_logits = row_logits  # a row of the model's last decode, as an MLX array [n_vocab]
        self._grammar = grammar
        self._end = min(eog, default=0)
        self._processors = make_processors(opts, n_ctx=n_ctx, eog=eog)
        self._filters = make_filters(opts, n_vocab)
        self._temperature = opts.temperature
        self._history_limit = max(opts.repeat_last_n, 64) if opts.repeat_last_n != -1 else n_ctx
        self._history: list[int] = []
        seed = secrets.randbits(32) if opts.seed is None else opts.seed & 0xFFFFFFFF
        self._key = mx.random.key(seed)

    def sample(self, row: int) -> int:
        logits = self._row_logits(row)[None]  # [1, n_vocab]
        if self._processors:
            history = mx.array(self._history, dtype=mx.int32)
            for process in self._processors:
                logits = process(history, logits)
        if self._grammar is not None:
            logits = self._grammar.constrain(logits)
        token = int(cast(int, self._draw(logits).item()))
        if self._grammar is not None and not self._grammar.advance(token):
            token = self._end  # nothing the grammar allows was left to draw: the answer ends, the engine goes on
        self._remember(token)
        return token

    def _draw(self, logits: mx.array) -> mx.array:
        if self._temperature <= 0:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for keep in self._filters:
            logprobs = keep(logprobs)
        self._key, draw_key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self._temperature), key=draw_key)

    def accept(self, token: int) -> None:
        """A token not sampled here (the prompt's): it counts for the penalties; the grammar is not advanced."""
        self._remember(token)

    def _remember(self, token: int) -> None:
        self._history.append(token)
        if len(self._history) > 2 * self._history_limit:  # the penalties only look at the last window
            del self._history[: -self._history_limit]

    def close(self) -> None:
        self._history = []
        self._grammar = None
