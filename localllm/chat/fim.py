"""Fill in the middle: the prompt an editor's completion is built into, from the model's own FIM tokens.

Code models learn `<PRE>prefix<SUF>suffix<MID>` and write the middle after it (Qwen2.5-Coder's `<|fim_prefix|>`...,
StarCoder's `<fim_prefix>`...); llama.cpp reads which tokens these are from the vocabulary. Other files the editor
sends go first, in the repository-level layout the models were trained on (`<REP>project <SEP>filename text ...`),
and the text after `<MID>` is the cursor line's start (llama-server's /infill `prompt`): typing on one line then
changes only the prompt's tail, so the rest stays in the prefix cache from one keystroke to the next."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import InvalidInput

PROJECT = "myproject"  # the repository name the layout needs; llama-server writes the same one


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's FIM tokens; `rep` and `sep` (repository and file separators) only some models have."""

    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None


@dataclass(frozen=True)
class FimInput:
    """An infill request's text: before and after the cursor, the cursor line's start, and other files."""

    prefix: str
    suffix: str
    middle: str = ""
    extra: Sequence[tuple[str, str]] = ()  # (filename, text)


def require_fim(model: str, tokens: FimTokens | None) -> FimTokens:
    """The model's FIM tokens, or the 400 for a model that has none."""
    if tokens is None:
        raise InvalidInput(
            f'"{model}" does not support insert (fill in the middle): its vocabulary has no FIM tokens',
            hint="use a code model such as qwen2.5-coder:0.5b for editor completion, or drop the suffix",
        )
    return tokens


def fim_prompt(
    tokens: FimTokens,
    text: FimInput,
    tokenize: Callable[[str], list[int]],
    *,
    budget: int,
    bos: int | None = None,
) -> list[int]:
    """The prompt's tokens, at most `budget` of them: the prefix keeps its end and the suffix its start (3:1 when
    both must be cut), and other files fill what room is left, the last ones kept. `tokenize` must not parse
    special tokens, so code that spells a FIM token stays text."""
    head = [bos] if bos is not None else []
    middle = tokenize(text.middle) if text.middle else []
    room = budget - len(head) - len(middle) - 3
    if room < 2:
        raise InvalidInput(f"the context of {budget} tokens has no room for the code around the cursor")
    prefix, suffix = tokenize(text.prefix), tokenize(text.suffix)
    suffix = suffix[: max(room // 4, room - len(prefix))]
    prefix = prefix[len(prefix) - min(len(prefix), room - len(suffix)) :]
    extra = _extra(tokens, text.extra, tokenize)
    extra = extra[len(extra) - min(len(extra), room - len(prefix) - len(suffix)) :]
    return head + extra + [tokens.pre, *prefix, tokens.suf, *suffix, tokens.mid, *middle]


def _extra(tokens: FimTokens, files: Sequence[tuple[str, str]], tokenize: Callable[[str], list[int]]) -> list[int]:
    """Other files as the repository-level layout has them (when the vocabulary has its tokens), else each after a
    plain separator line; the file being edited is announced last."""
    out: list[int] = []
    if tokens.rep is not None:
        out += [tokens.rep, *tokenize(PROJECT + "\n")]
    for filename, body in files:
        if tokens.sep is not None:
            out += [tokens.sep, *tokenize((filename or "tmp") + "\n")]
        else:
            out += tokenize("\n\n--- snippet ---\n\n")
        out += tokenize(body)
    if tokens.sep is not None:
        out += [tokens.sep, *tokenize("filename\n")]
    return out
