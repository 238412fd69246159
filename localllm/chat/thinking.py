"""Reasoning models: which models can think, how a request asks them to, and the thinking split from the answer.

A reasoning model writes `<think>...</think>` before its answer (DeepSeek-R1, Qwen3, SmolLM3); its chat template
either writes the tags or takes `enable_thinking` / `reasoning_effort`. Every surface asks in its own words (Ollama
`think`, OpenAI `reasoning_effort`, Anthropic `thinking`); they all become one `Think` value here, and the answer
streams through a `ThinkingSplitter`, which holds back a tag split across tokens until it can tell."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInput

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
LEVELS = ("low", "medium", "high")

# What a template shows when it can think: it writes the tags, takes a variable that turns thinking on or off, or
# shows earlier turns' thinking (Jinja from GGUF metadata, or an Ollama Go template).
_THINKING_MARKS = (OPEN_TAG, "enable_thinking", "reasoning_effort", "reasoning_content", ".Thinking", ".Think")


def supports_thinking(template: str | None) -> bool:
    """Whether a chat template belongs to a reasoning model (the `thinking` capability)."""
    return bool(template) and any(mark in template for mark in _THINKING_MARKS)  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------------------- control


@dataclass(frozen=True)
class Think:
    """What a request asked for: on or off (None: the model's default) and how hard (a level, or None)."""

    enabled: bool | None = None
    level: str | None = None

    @property
    def requested(self) -> bool:
        return self.enabled is True

    def template_variables(self) -> dict[str, Any]:
        """The variables reasoning templates read: Qwen3's enable_thinking, gpt-oss's reasoning_effort."""
        variables: dict[str, Any] = {}
        if self.enabled is not None:
            variables["enable_thinking"] = self.enabled
        if self.level is not None:
            variables["reasoning_effort"] = self.level
        return variables


def parse_think(value: bool | str | None, *, field_name: str = "think") -> Think:
    """Ollama's `think`: true, false, or a level ("low", "medium", "high"); None leaves the model's default."""
    if value is None:
        return Think()
    if isinstance(value, bool):
        return Think(enabled=value)
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return Think(enabled=text == "true")
    if text in LEVELS:
        return Think(enabled=True, level=text)
    raise InvalidInput(f"{field_name} {value!r} is not valid", hint='use true, false, "low", "medium" or "high"')


def think_from_effort(effort: str | None, *, field_name: str = "reasoning_effort") -> bool | str | None:
    """OpenAI's reasoning effort as Ollama's `think`: "none" turns thinking off, "minimal" is the lowest level."""
    if effort is None:
        return None
    text = effort.strip().lower()
    if text == "none":
        return False
    if text == "minimal":
        return "low"
    if text in LEVELS:
        return text
    raise InvalidInput(f"{field_name} {effort!r} is not valid", hint="use none, minimal, low, medium or high")


def check_thinking(model: str, template: str | None, think: Think) -> None:
    """Ollama's 400 for a request that asks a model without the capability to think."""
    if think.requested and not supports_thinking(template):
        raise InvalidInput(
            f'"{model}" does not support thinking',
            hint="`localllm show MODEL` lists thinking among a reasoning model's capabilities",
        )


def opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt leaves a think block open (DeepSeek-R1-style templates write `<think>` for the
    model), so the answer starts inside it."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN_TAG)


# ---------------------------------------------------------------------------------------------------------- grammar


def thinking_grammar(answer: str, *, opened: bool) -> str:
    """A grammar for a thinking model with structured output: a think block first, then `answer` (Ollama applies
    `format` after the thinking too). The block's text cannot hold `<`, so a `<` can only begin the closing tag, and
    it holds more than whitespace."""
    renamed = re.sub(r"(?m)^root(\s*::=)", r"answer-root\1", answer)
    head = "" if opened else '"<think>" '
    return (
        f'root ::= {head}think-text "</think>" think-gap answer-root\n'
        "think-text ::= [ \\t\\n]* [^< \\t\\n] [^<]*\n"
        "think-gap ::= [ \\t\\n]*\n" + renamed
    )


# ---------------------------------------------------------------------------------------------------------- splitting


@dataclass
class Split:
    thinking: str = ""
    content: str = ""


@dataclass
class ThinkingSplitter:
    """Feed answer text, get (thinking, content). A think block counts only at the start of the answer (after
    whitespace); `opened` starts inside one, when the prompt opened it. Whitespace around the block is dropped."""

    opened: bool = False
    _state: str = field(default="start", init=False)
    _pending: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.opened:
            self._state = "think-start"

    @property
    def thinking(self) -> bool:
        """Whether the text now arriving is thinking."""
        return self._state in ("think-start", "think")

    def feed(self, text: str) -> Split:
        self._pending += text
        out = Split()
        while self._pending and self._step(out):
            pass
        return out

    def flush(self) -> Split:
        """The end of the answer: what was held back is released (an unfinished tag is text after all)."""
        out = Split()
        rest, self._pending = self._pending, ""
        if self._state == "think":
            out.thinking = rest
        elif self._state == "content" or (self._state == "start" and rest.strip()):
            out.content = rest.lstrip() if self._state == "start" else rest
        return out

    def _step(self, out: Split) -> bool:
        """Consume what can be decided now; False when the rest must wait for more text."""
        if self._state in ("start", "think-start", "after"):
            return self._skip_space()
        if self._state == "think":
            return self._in_thinking(out)
        out.content += self._pending
        self._pending = ""
        return False

    def _skip_space(self) -> bool:
        """Whitespace before the block, at its start and after it is dropped; at the start, a tag opens the block."""
        stripped = self._pending.lstrip()
        if not stripped:
            self._pending = "" if self._state != "start" else self._pending
            return False
        if self._state != "start":
            self._pending, self._state = stripped, "think" if self._state == "think-start" else "content"
            return True
        if stripped.startswith(OPEN_TAG):
            self._pending, self._state = stripped[len(OPEN_TAG) :], "think-start"
            return True
        if OPEN_TAG.startswith(stripped):
            return False  # maybe the start of the tag: wait
        self._pending, self._state = stripped, "content"
        return True

    def _in_thinking(self, out: Split) -> bool:
        end = self._pending.find(CLOSE_TAG)
        if end >= 0:
            out.thinking += self._pending[:end]
            self._pending, self._state = self._pending[end + len(CLOSE_TAG) :], "after"
            return True
        hold = held_back(self._pending, CLOSE_TAG)
        out.thinking += self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        return False


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: what a stream holds back while
    the marker (a stop sequence, a closing tag) may still be arriving."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
