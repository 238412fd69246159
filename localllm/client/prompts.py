"""Prompt assembly: a request becomes the text the model's chat template renders, then its tokens. Plain functions
over the model's facts and its tokenizer (PromptModel), as Ollama's server/prompt.go builds `chatPrompt` over a
tokenize callable: nothing here loads, queues or decodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .. import api
from ..chat.fim import FimInput, FimTokens, fim_prompt
from ..chat.sandbox import MAX_OUTPUT_CHARS
from ..chat.special_tokens import TypedSpecials, find_typed, hide_typed, strings_in, tokenize_rendered
from ..chat.templates import render_chat
from ..chat.thinking import Think
from ..errors import InvalidInput, PayloadTooLarge
from ..media import PromptImage
from ..models.store import ResolvedModel
from .images import ImageTokens, MarkedImages, mark_messages, tokenize_marked


class Tokenize(Protocol):
    def __call__(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class PromptModel:
    """What prompt assembly reads of a loaded model."""

    template: str | None  # the chat template; None: the plain transcript (a base model)
    bos: str  # the BOS token's text, "" when the model has none
    eos: str
    tokenize: Tokenize
    token_text: Callable[[int], str]  # a token's own text, control tokens included
    image_tokens: ImageTokens


@dataclass(frozen=True)
class Rendered:
    """A prompt rendered by the chat template; `typed`: the control tokens its request's text spells, behind marks
    in `text` (chat/special_tokens.py), None when it spells none."""

    text: str
    typed: TypedSpecials | None = None

    @property
    def shown(self) -> str:
        """The text as the model reads it: typed spellings back in place."""
        return self.typed.show(self.text) if self.typed else self.text


def chat_template(model: ResolvedModel, loaded_template: str | None, override: str | None = None) -> str | None:
    """The chat template a prompt is rendered with (the request's, the Modelfile's, the weights'); None means the
    plain transcript (a base model)."""
    return override or model.template or loaded_template


def messages_with_system(model: ResolvedModel, system: str | None, messages: list[api.Message]) -> list[api.Message]:
    """Modelfile MESSAGEs first, then the system prompt (the request's, else the Modelfile's) unless the conversation
    brings its own."""
    out = list(model.messages) + list(messages)
    system_text = system if system is not None else model.system
    if system_text and not any(m.role == "system" for m in out):
        out.insert(0, api.Message(role="system", content=system_text))
    return out


def render(
    prompt: PromptModel,
    messages: list[api.Message],
    *,
    tools: list | None = None,
    extra: dict[str, Any] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Rendered:
    """The conversation in the model's template. Messages and tools are the request's text, never markup: the
    control tokens they spell are hidden from the template and tokenized as text (only the template's own markup
    is parsed, as llama.cpp's parse_special per piece)."""
    data = [m.model_dump(exclude_none=True) for m in messages]
    typed = find_typed(strings_in([data, tools]), _tokenizer(prompt), prompt.token_text)
    text = render_chat(
        prompt.template,
        hide_typed(data, typed),
        tools=hide_typed(tools, typed),
        bos_token=prompt.bos,
        eos_token=prompt.eos,
        extra=extra,
        cancelled=cancelled,
    )
    return Rendered(text, typed)


def _tokenizer(prompt: PromptModel) -> Callable[[str, bool, bool], list[int]]:
    return lambda text, add_special, parse_special: prompt.tokenize(
        text, add_special=add_special, parse_special=parse_special
    )


def tokenize_prompt(
    prompt: PromptModel, text: str, typed: TypedSpecials | None = None, *, first: bool = True
) -> list[int]:
    """A rendered prompt's tokens (`first`: it starts the prompt, so it gets the BOS): the template's markup parsed
    for control tokens, the typed spellings as text."""
    # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
    add_special = first and not (prompt.bos and text.startswith(prompt.bos))
    return tokenize_rendered(text, typed, _tokenizer(prompt), prompt.token_text, add_special=add_special)


def tokenize_text(prompt: PromptModel, text: str) -> list[int]:
    """A user's text on its own (an input to embed): the model's BOS/EOS added, every spelling in it text."""
    return prompt.tokenize(text, add_special=True, parse_special=False)


def tokenize_with_images(
    prompt: PromptModel, rendered: Rendered, marks: MarkedImages | None
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt's tokens and its images (their marks replaced by each image's piece)."""
    if marks is None:
        return tokenize_prompt(prompt, rendered.text, rendered.typed), ()

    def tokenize(piece: str, first: bool) -> list[int]:
        return tokenize_prompt(prompt, piece, rendered.typed, first=first)

    return tokenize_marked(rendered.text, marks, tokenize, prompt.image_tokens)


def chat_text(
    prompt: PromptModel,
    model: ResolvedModel,
    messages: list[api.Message],
    tools: list[api.Tool] | None,
    think: Think,
    cancelled: Callable[[], bool] | None = None,
) -> tuple[Rendered, MarkedImages | None]:
    """A chat's prompt text (the Modelfile's messages and system first) with its images' marks."""
    with_system = messages_with_system(model, None, messages)
    marked, marks = mark_messages(with_system, added=len(with_system) - len(messages))
    rendered = render(
        prompt,
        marked,
        tools=[t.model_dump() for t in tools] if tools else None,
        extra=think.template_variables(),
        cancelled=cancelled,
    )
    return rendered, marks


def generate_text(
    prompt: PromptModel,
    model: ResolvedModel,
    request: api.GenerateRequest,
    think: Think,
    cancelled: Callable[[], bool] | None = None,
) -> Rendered:
    """A generate request's text: its prompt as one user turn in the template, or as it is when raw (the user's
    whole prompt, its special tokens parsed, as Ollama's raw mode and llama-server's /completion take it)."""
    if request.raw:
        return Rendered(request.prompt)
    messages = messages_with_system(model, request.system, [api.Message(role="user", content=request.prompt)])
    return render(prompt, messages, extra=think.template_variables(), cancelled=cancelled)


def wants_fim(request: api.GenerateRequest, model_fills: bool) -> bool:
    """A suffix (or /infill's other fields) asks for fill in the middle; an empty suffix only of a model that can,
    as Ollama then answers the plain prompt."""
    if request.suffix or request.input_extra or request.middle is not None:  # /infill always sets middle
        return True
    return request.suffix is not None and model_fills


def infill_tokens(
    fim: FimTokens, request: api.GenerateRequest, tokenize: Tokenize, *, n_ctx: int, num_predict: int, bos: int | None
) -> list[int]:
    """Fill in the middle (chat/fim.py): the prompt is the code around the cursor between the model's FIM tokens,
    not a chat turn; the room left for the answer is kept free of it."""
    text = FimInput(
        prefix=request.prompt,
        suffix=request.suffix or "",
        middle=request.middle or "",
        extra=[(f.filename, f.text) for f in request.input_extra or []],
    )
    reserve = num_predict if 0 < num_predict < n_ctx // 2 else n_ctx // 4
    return fim_prompt(
        fim,
        text,
        lambda piece: tokenize(piece, add_special=False, parse_special=False),
        budget=n_ctx - reserve,
        bos=bos,
    )


# Characters of text one context token stands for, at most, in the early bound below: far above what any tokenizer
# packs into a token on average (English is about 4), so only text that could never fit is refused by it.
PROMPT_CHARS_PER_TOKEN = 64


def prompt_chars_bound(n_ctx: int) -> int:
    """The most characters a request's text may hold for a context of `n_ctx` tokens (never over what a chat
    template may render)."""
    return min(n_ctx * PROMPT_CHARS_PER_TOKEN, MAX_OUTPUT_CHARS)


def check_text_size(chars: int, n_ctx: int, what: str) -> None:
    """Refuse text far larger than the context could ever hold, before it is templated, decoded or tokenized: a
    20 MB prompt would otherwise take gigabytes on its way to the overflow error. Truncation and fill-in-the-middle
    cut a prompt to the context, so the bound is generous, not the context itself."""
    bound = prompt_chars_bound(n_ctx)
    if chars > bound:
        raise PayloadTooLarge(
            f"{what} is {chars:,} characters, more than a context of {n_ctx:,} tokens could ever hold: the limit is "
            f"{bound:,} ({PROMPT_CHARS_PER_TOKEN} characters per token)",
            hint="send less text, or load the model with a larger num_ctx",
        )


def check_message_count(messages: list[api.Message]) -> None:
    """Refuse a conversation of more than api.MAX_MESSAGES messages before it is templated."""
    if len(messages) > api.MAX_MESSAGES:
        raise InvalidInput(
            f"the conversation holds {len(messages):,} messages; the limit is {api.MAX_MESSAGES:,} per request",
            hint="send the latest messages only, or summarise the earlier ones",
        )


def generate_chars(request: api.GenerateRequest) -> int:
    """The characters of a generate (or fill-in-the-middle) request's own text."""
    pieces = (request.prompt, request.system, request.suffix, request.middle)
    return sum(len(p or "") for p in pieces) + sum(len(f.text) for f in request.input_extra or [])


def message_chars(messages: list[api.Message]) -> int:
    """The characters of a conversation's text (contents and thinking)."""
    return sum(len(m.content) + len(m.thinking or "") for m in messages)


def checked_tokens(tokens: list[int], n_vocab: int, what: str) -> list[int]:
    """Token ids from the client, checked against the vocabulary before they reach native code."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidInput(f"{what} holds token id {bad}, outside the model's vocabulary of {n_vocab}")
    return list(tokens)


def require_vision(vision: bool, name: str, n_images: int) -> None:
    """Refuse images for a model without a vision projector, before decoding any (Ollama's wording)."""
    if n_images and not vision:
        raise InvalidInput(
            "this model is missing data required for image input",
            hint=f"{name} has no vision projector; use a model whose `localllm show` lists vision",
        )
