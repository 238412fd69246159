"""Special tokens typed by a user stay text. A chat template's own markup (`<|im_start|>`, `<end_of_turn>`) becomes
the model's control tokens; the conversation it renders does not: a message that spells `<|im_end|>` must not end
its turn and forge the next one. This is llama.cpp's `parse_special` applied per piece: markup parsed, text not.

Before rendering, each control-token spelling in the request's text is replaced by a mark carrying a nonce of this
request (so text cannot forge a mark either); after rendering, the prompt is cut into llama.cpp's fragments at the
template's own control tokens, and the marks go back to their spellings inside the text fragments. A request whose
text spells no control token is rendered and tokenized exactly as before: there is nothing to mark."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special) -> token ids
Spell = Callable[[int], str]  # a token's own text, control tokens included


@dataclass(frozen=True)
class TypedSpecials:
    """The control-token spellings found in one request's text, each hidden behind a mark of this request."""

    spellings: tuple[str, ...]  # longest first, as llama.cpp matches special tokens
    nonce: str

    def mark(self, index: int) -> str:
        return f"<__text_{self.nonce}_{index}__>"

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(rf"<__text_{self.nonce}_(\d+)__>")

    def hide(self, text: str) -> str:
        for index, spelling in enumerate(self.spellings):
            text = text.replace(spelling, self.mark(index))
        return text

    def show(self, text: str) -> str:
        """`text` with each mark back to the spelling it hides."""
        return self.pattern.sub(lambda match: self.spellings[int(match.group(1))], text)


def find_typed(texts: Iterable[str], tokenize: Tokenize, spell: Spell) -> TypedSpecials | None:
    """The control tokens that `texts` spell (None: they spell none). A control token is what the tokenizer parses
    only when asked to parse special tokens; one joined tokenization finds them all (NUL is in no token's text)."""
    spellings = _control_tokens("\x00".join(texts), tokenize, spell)
    if not spellings:
        return None
    return TypedSpecials(tuple(sorted(spellings, key=len, reverse=True)), secrets.token_hex(8))


def hide_typed(value: Any, typed: TypedSpecials | None) -> Any:
    """`value` (a message or tool as plain data) with every string in it, keys included, hiding its spellings."""
    if typed is None:
        return value
    if isinstance(value, str):
        return typed.hide(value)
    if isinstance(value, dict):
        return {hide_typed(k, typed): hide_typed(v, typed) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [hide_typed(v, typed) for v in value]
    return value


def strings_in(value: Any) -> Iterable[str]:
    """Every string in plain data, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_in(k)
            yield from strings_in(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from strings_in(v)


def tokenize_rendered(
    text: str, typed: TypedSpecials | None, tokenize: Tokenize, spell: Spell, *, add_special: bool
) -> list[int]:
    """The tokens of a rendered prompt: the template's control tokens parsed, the request's text (its marks shown
    again) tokenized as text, fragment by fragment as llama.cpp cuts a prompt; `add_special`: BOS first."""
    if typed is None or not typed.pattern.search(text):
        return tokenize(text, add_special, True)
    tokens = tokenize("", True, False) if add_special else []
    for fragment in _fragments(text, _control_tokens(text, tokenize, spell)):
        tokens += [fragment] if isinstance(fragment, int) else tokenize(typed.show(fragment), False, False)
    return tokens


def _control_tokens(text: str, tokenize: Tokenize, spell: Spell) -> dict[str, int]:
    """The control tokens `text` spells, by spelling. The candidates are the tokens that parsing special tokens
    brings in; each must also be one on its own (a plain token merged otherwise next to a spelling is not)."""
    if not text:
        return {}
    candidates = set(tokenize(text, False, True)) - set(tokenize(text, False, False))
    spellings = {token: spell(token) for token in candidates}
    return {s: token for token, s in spellings.items() if s and _is_control(token, s, tokenize)}


def _is_control(token: int, spelling: str, tokenize: Tokenize) -> bool:
    return tokenize(spelling, False, True) == [token] and tokenize(spelling, False, False) != [token]


def _fragments(text: str, controls: dict[str, int]) -> list[str | int]:
    """`text` cut at each control token's spelling, longest spellings first (llama.cpp's tokenizer_st_partition):
    text fragments and token ids in order."""
    fragments: list[str | int] = [text]
    for spelling in sorted(controls, key=len, reverse=True):
        cut: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                cut.append(fragment)
                continue
            for i, part in enumerate(fragment.split(spelling)):
                if i:
                    cut.append(controls[spelling])
                if part:
                    cut.append(part)
        fragments = cut
    return fragments
