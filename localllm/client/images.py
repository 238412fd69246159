"""Prompts with images: each image is decoded (media.py: bounded first, each image and the request's images together,
from their headers before the first is decoded), marked in its message's text, and the
rendered prompt is tokenized piece by piece around the marks, each mark becoming the model's own piece for that
image (its wrapper tokens and placeholders: LoadedModel.image_tokens).

An image goes before its message's text, once per image, as llama-mtmd-cli puts mtmd's marker before the prompt.
The marks carry a nonce of this request, so text that looks like one is just text."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import api
from ..errors import InvalidInput
from ..media import (
    ImagePixels,
    PromptImage,
    check_image_count,
    check_request_pixels,
    decode_image,
    image_bytes,
    image_pixels,
    is_placeholder,
)

Tokenize = Callable[[str, bool], list[int]]  # (text, first piece) -> tokens
ImageTokens = Callable[[ImagePixels], list[int]]


@dataclass(frozen=True)
class MarkedImages:
    """The images of one request in prompt order, and the mark each stands at in the rendered text."""

    images: tuple[ImagePixels, ...]
    nonce: str

    def mark(self, index: int) -> str:
        return f"<__image_{self.nonce}_{index}__>"

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(rf"<__image_{self.nonce}_(\d+)__>")


def mark_messages(messages: Sequence[api.Message], *, added: int = 0) -> tuple[list[api.Message], MarkedImages | None]:
    """The messages with each image's mark before their text, and the decoded images (None: there are none);
    `added` messages (a Modelfile's system and messages) lead the request's, whose numbers errors give."""
    check_image_count(sum(len(m.images or []) for m in messages))
    if not any(m.images for m in messages):
        return list(messages), None
    files = [
        (image_bytes(text, what=what), what)
        for n, message in enumerate(messages)
        for i, text in enumerate(message.images or [])
        for what in [f"image {i + 1} of message {n + 1 - added}"]
    ]
    check_request_pixels(sum(image_pixels(data, what=what) for data, what in files))
    pixels = [decode_image(data, what=what) for data, what in files]  # one at a time, once all are in budget
    nonce = secrets.token_hex(8)
    marked, index = [], 0
    for message in messages:
        marks = ""
        for _ in message.images or []:
            marks += f"<__image_{nonce}_{index}__>"
            index += 1
        marked.append(message.model_copy(update={"content": marks + message.content, "images": None}))
    return marked, MarkedImages(tuple(pixels), nonce)


def mark_prompt(prompt: str, images: Sequence[str] | None) -> tuple[str, MarkedImages | None]:
    """/api/generate's prompt with its images' marks before it."""
    if not images:
        return prompt, None
    messages, marks = mark_messages([api.Message(role="user", content=prompt, images=list(images))])
    return messages[0].content, marks


def tokenize_marked(
    text: str, marks: MarkedImages, tokenize: Tokenize, image_tokens: ImageTokens
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The rendered prompt's tokens, each mark replaced by its image's piece; every image must appear once."""
    tokens: list[int] = []
    found: list[PromptImage] = []
    last = 0
    for match in marks.pattern.finditer(text):
        if last == 0 or match.start() > last:  # the first piece, even empty, gets the BOS
            tokens += tokenize(text[last : match.start()], last == 0)
        pixels = marks.images[int(match.group(1))]
        piece = image_tokens(pixels)
        tokens += piece
        found.append(PromptImage(pixels, tuple(t for t in piece if is_placeholder(t))))
        last = match.end()
    if len(found) != len(marks.images):
        raise InvalidInput(
            f"the chat template showed {len(found)} of the request's {len(marks.images)} images",
            hint="the template must render each message's content in full",
        )
    tokens += tokenize(text[last:], False)
    return tokens, tuple(found)
