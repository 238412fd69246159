"""Image files for the terminal chat: `/image PATH`, and paths inside a message as Ollama's terminal chat takes them.

A path in a message ends in .jpg, .jpeg, .png or .webp (any case); it is absolute, relative or under ~, quoted ('…'
or "…") or with its spaces escaped by backslashes, as a shell or a file manager's drag and drop writes it. Only a
path that names a file counts: any other stays text, since it may be just a word ("rename it to final.png")."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInput
from ..media import MAX_IMAGE_BYTES, decode_image

_SUFFIX = r"\.(?:jpe?g|png|webp)"
# A path starts a word; a quoted one runs to its closing quote, a bare one to the first unescaped blank. A sentence's
# punctuation after a bare path ("what is ./cat.png?") is no part of it.
_MENTION = re.compile(
    rf"""(?<![^\s(])(?P<quote>['"])(?P<quoted>[^'"\n]+?{_SUFFIX})(?P=quote)"""
    rf"""|(?<![^\s(])(?P<bare>(?:\\.|[^\s'"\\])+?{_SUFFIX})(?=$|[\s,;:!?)'"]|\.(?:\s|$))""",
    re.IGNORECASE,
)
_ESCAPED = re.compile(r"\\([^\w])")  # "\ " is a space, "\(" a parenthesis; "\w" stays (a Windows separator)


@dataclass(frozen=True)
class ImageMention:
    """Where a message names an image file: text[start:end] is the path as typed, `path` the file."""

    start: int
    end: int
    path: Path


def find_image_files(text: str) -> list[ImageMention]:
    """The image files `text` names, in order; a path that names no file is left out."""
    mentions = []
    for match in _MENTION.finditer(text):
        typed = match.group("quoted") or _ESCAPED.sub(r"\1", match.group("bare"))
        path = Path(typed).expanduser()
        if path.is_file():
            mentions.append(ImageMention(match.start(), match.end(), path))
    return mentions


def cut_mentions(text: str, mentions: list[ImageMention]) -> str:
    """`text` without the paths: one space where words stood on both sides of one, none before punctuation."""
    bounds = [0, *(edge for mention in mentions for edge in (mention.start, mention.end)), len(text)]
    kept = text[: bounds[1]]
    for start, end in zip(bounds[2::2], bounds[3::2], strict=True):
        piece = text[start:end]
        gap = " " if piece[:1] in (" ", "\t") and kept.rstrip(" \t") else ""
        kept = kept.rstrip(" \t") + gap + piece.lstrip(" \t")
    return kept.strip()


def read_image_file(path: Path) -> str:
    """The file's bytes, base64, once they are checked as an image localllm reads (InvalidInput naming the file)."""
    if not path.is_file():
        raise InvalidInput(f"no image file at {path}")
    size = path.stat().st_size
    if size > MAX_IMAGE_BYTES:  # told before reading the file
        raise InvalidInput(f"{path} is {size:,} bytes; the limit is {MAX_IMAGE_BYTES:,}")
    data = path.read_bytes()
    decode_image(data, what=str(path))
    return base64.b64encode(data).decode()
