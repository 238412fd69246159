"""One chat as the terminal chat and the TUI keep it: the model, the system prompt, the options the user set, the
messages so far, and running figures about the answers. It builds `api.ChatRequest`s and records answers; sending
them is the surface's business, through a Client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import api
from .chat.thinking import parse_think
from .errors import InvalidInput, LocalLLMError
from .models.catalog import find_entry
from .models.names import parse_ref

# ---------------------------------------------------------------------------------------------------------- options


def parse_parameter(name: str, words: Sequence[str]) -> Any:
    """Turn `/set parameter NAME VALUE...` into the option's typed value, or raise InvalidInput naming it.

    `stop` takes every word as one stop string (Ollama: `/set parameter stop <s> <s>...`); the others take one word.
    """
    if not words:
        raise InvalidInput(f"parameter {name!r} needs a value", hint="/set parameter NAME VALUE")
    typed = api.parse_option(name, list(words) if name == "stop" else " ".join(words))
    if typed is None:
        raise InvalidInput(f"parameter {name!r} has no effect in localllm")
    return typed


def is_model(row: api.ProcessModel, name: str) -> bool:
    """Whether a loaded model (a `ps` row) is `name`, however it is spelled: `me/chat` is `me/chat:latest`."""
    return bool({row.name, row.model} & {name, *_spellings(name)})


def _spellings(name: str) -> set[str]:
    # `smollm2` may be the stored `smollm2:latest` or, when none is, the catalog's `smollm2:135m`.
    try:
        ref = parse_ref(name)
    except LocalLLMError:
        return set()
    entry = find_entry(ref)
    return {ref.display} | ({entry.name} if entry is not None else set())


# ---------------------------------------------------------------------------------------------------------- figures


@dataclass
class AnswerFigures:
    """Running totals over a conversation's answers, from the timings of each answer's last chunk."""

    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    eval_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    last: api.Timings | None = None

    def add(self, timings: api.Timings) -> None:
        self.answers += 1
        self.prompt_tokens += timings.prompt_eval_count
        self.cached_tokens += timings.prompt_cache_count
        self.generated_tokens += timings.eval_count
        self.eval_seconds += timings.eval_duration / 1e9
        self.drafted += timings.draft_count
        self.accepted += timings.draft_accepted
        self.last = api.Timings.model_validate(timings.model_dump())

    @property
    def tokens_per_second(self) -> float | None:
        return self.generated_tokens / self.eval_seconds if self.eval_seconds > 0 else None

    @property
    def cache_share(self) -> float | None:
        """The share of prompt tokens that were reused from the prefix cache instead of evaluated."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def acceptance(self) -> float | None:
        """The share of drafted tokens the target model accepted; None while nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None


def rate(count: int, duration_ns: int) -> float | None:
    """Tokens per second from a count and a duration in nanoseconds (Ollama's timing fields)."""
    return count / (duration_ns / 1e9) if duration_ns > 0 else None


# ---------------------------------------------------------------------------------------------------------- chat


@dataclass
class Conversation:
    """What the user has said and set in one chat with one model."""

    model: str
    system: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    messages: list[api.Message] = field(default_factory=list)
    format: api.Format = None
    keep_alive: float | None = None  # seconds, as api.Duration reads them
    think: bool | str | None = None  # Ollama's think: None leaves the model's default
    figures: AnswerFigures = field(default_factory=AnswerFigures)

    def ask(self, text: str, images: list[str] | None = None) -> api.ChatRequest:
        """Add the user's message (with `images`, base64) and return the request that asks for the answer."""
        self.messages.append(api.Message(role="user", content=text, images=images or None))
        return self.request()

    def request(self) -> api.ChatRequest:
        # The system prompt is sent with every request rather than kept in the history, so /set system applies to
        # the next answer without rewriting the past.
        system = [api.Message(role="system", content=self.system)] if self.system else []
        return api.ChatRequest(
            model=self.model,
            messages=system + self.messages,
            options=dict(self.options),
            format=self.format,
            keep_alive=self.keep_alive,
            think=self.think,
        )

    def load_request(self) -> api.ChatRequest:
        """A request with no messages: it loads the model (with the load options set so far) and answers done."""
        return api.ChatRequest(model=self.model, options=dict(self.options), keep_alive=self.keep_alive)

    def answered(self, content: str, timings: api.Timings | None = None, *, thinking: str = "") -> None:
        """Record an answer (and its thinking); an interrupted one (no timings) is kept too, so the history still
        alternates."""
        if content or thinking:
            self.messages.append(api.Message(role="assistant", content=content, thinking=thinking or None))
        if timings is not None:
            self.figures.add(timings)

    def withdraw(self) -> None:
        """Drop the last question when it got no answer at all (an error before the first token)."""
        if self.messages and self.messages[-1].role == "user":
            self.messages.pop()

    def set_think(self, value: bool | str | None) -> None:
        """Think (True or a level), not (False), or the model's default (None); a bad level is an InvalidInput."""
        self.think = parse_think(value).level or parse_think(value).enabled

    def set_parameter(self, name: str, words: Sequence[str]) -> Any:
        value = parse_parameter(name, words)
        self.options[name] = value
        return value

    def switch_model(self, model: str) -> None:
        """Talk to another model from now on; the history starts afresh (as Ollama's /load does)."""
        self.model = model
        self.messages.clear()

    def clear(self) -> None:
        self.messages.clear()

    def session(self) -> api.PromptCacheSession:
        """What a prompt-cache file keeps of this chat besides its cache."""
        return api.PromptCacheSession(
            model=self.model,
            system=self.system,
            options=dict(self.options),
            messages=list(self.messages),
            format=self.format,
        )

    def resume(self, session: api.PromptCacheSession) -> None:
        """Go on with a chat kept in a prompt-cache file: its model, system prompt, options and messages."""
        self.model, self.system, self.format = session.model, session.system, session.format
        self.options = dict(session.options)
        self.messages = list(session.messages)

    def create_request(self, name: str) -> api.CreateRequest:
        """What `/save NAME` stores: this model with the session's system prompt, parameters and messages."""
        return api.CreateRequest(
            model=name,
            from_=self.model,
            system=self.system,
            parameters=dict(self.options),
            messages=list(self.messages),
        )
