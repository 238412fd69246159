"""Images from requests, checked and decoded before any native code sees them: base64 text in, RGB pixels out.

Every size is bounded before the work it would cost: the base64 text before decoding it, the file's bytes, the count
per request, and the pixels its header declares before Pillow decodes one (a small PNG can declare 30000x30000: a
decompression bomb), each image's and all of a request's together (sixteen small PNGs of 4096x4096 zeros would
decode to 768 MB of RGB), read from every header before the first image is decoded. PNG, JPEG, WebP and GIF (its
first frame) are read, with Pillow; mtmd gets pixels, never files.
Pillow is imported here only, at the first image."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInput

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image file
MAX_IMAGES = 16  # per request, over all its messages
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height, as the file's header declares them
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS  # all of a request's images (projectors scale each down far below this)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class ImagePixels:
    """An image decoded to 8-bit RGB, rows top to bottom: what a projector reads. `digest` is the sha256 of the
    file's bytes: the key the prefix cache tells images apart by, as llama-server hashes image bytes."""

    width: int
    height: int
    rgb: bytes
    digest: str


@dataclass(frozen=True)
class PromptImage:
    """An image in a prompt: its pixels and the placeholder ids that stand for its embeddings there (negative ids,
    derived from the digest: equal images give equal placeholders, so prefix reuse works as for text)."""

    pixels: ImagePixels
    placeholders: tuple[int, ...]


def is_placeholder(token: int) -> bool:
    return token < 0


def check_image_count(n: int) -> None:
    if n > MAX_IMAGES:
        raise InvalidInput(
            f"the request holds {n} images; the limit is {MAX_IMAGES}", hint="send fewer images per request"
        )


def check_request_pixels(total: int) -> None:
    """Refuse a request whose images together declare more pixels than MAX_REQUEST_PIXELS."""
    if total > MAX_REQUEST_PIXELS:
        raise InvalidInput(
            f"the request's images are {total:,} pixels together; the limit is {MAX_REQUEST_PIXELS:,} per request "
            "(checked before decoding)",
            hint="send fewer or smaller images",
        )


def decode_base64_image(text: str, *, what: str = "image") -> ImagePixels:
    """`text` (base64, as Ollama's `images` and data URIs carry it) as pixels; InvalidInput naming `what`."""
    return decode_image(image_bytes(text, what=what), what=what)


def image_bytes(text: str, *, what: str = "image") -> bytes:
    """The file's bytes of base64 `text`, refused before decoding when they would be too many."""
    text = text.strip()
    size = len(text.rstrip("=")) * 3 // 4  # the bytes it decodes to, told before decoding
    if size > MAX_IMAGE_BYTES:
        raise _too_big(what, size)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{what} is not valid base64", hint="send the image file's bytes base64-encoded") from None


def image_pixels(data: bytes, *, what: str = "image") -> int:
    """The pixels an image file's header declares (nothing is decoded), refused above MAX_IMAGE_PIXELS."""
    with _opened(data, what) as image:
        return image.size[0] * image.size[1]


def decode_image(data: bytes, *, what: str = "image") -> ImagePixels:
    """An image file's bytes as pixels, refused before decoding when too large in bytes or declared pixels."""
    with _opened(data, what) as image:
        try:
            image.seek(0)  # a GIF's first frame
            rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt file, found while decoding
            raise InvalidInput(f"{what} could not be decoded: {exc}", hint="send the whole, unmodified file") from None
    return ImagePixels(rgb.width, rgb.height, rgb.tobytes(), hashlib.sha256(data).hexdigest())


@contextlib.contextmanager
def _opened(data: bytes, what: str) -> Iterator[Any]:
    """The image file opened by Pillow, its header read and its size checked; no pixel decoded yet."""
    if len(data) > MAX_IMAGE_BYTES:
        raise _too_big(what, len(data))
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InvalidInput("reading images needs Pillow", hint="pip install pillow") from None
    try:
        # open() reads the header only; its own bomb check fires for far larger images than our limit.
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError as exc:
        raise InvalidInput(
            f"{what} declares more than {MAX_IMAGE_PIXELS:,} pixels ({exc})", hint="send a smaller image"
        ) from None
    except UnidentifiedImageError:
        raise InvalidInput(
            f"{what} is not an image localllm reads", hint=f"send {', '.join(FORMATS[:-1])} or {FORMATS[-1]}"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:  # a header that does not parse
        raise InvalidInput(f"{what} could not be decoded: {exc}", hint="send the whole, unmodified file") from None
    with image:
        _check_pixels(what, *image.size)
        yield image


def _check_pixels(what: str, width: int, height: int) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidInput(
            f"{what} is {width}x{height} = {width * height:,} pixels; the limit is {MAX_IMAGE_PIXELS:,} "
            "(checked before decoding)",
            hint="scale the image down before sending it",
        )
    if width < 1 or height < 1:
        raise InvalidInput(f"{what} is {width}x{height}: it has no pixels")


def _too_big(what: str, size: int) -> InvalidInput:
    return InvalidInput(
        f"{what} is {size:,} bytes; the limit is {MAX_IMAGE_BYTES:,}", hint="send a smaller or more compressed image"
    )


def data_uri_image(url: str, *, where: str) -> str:
    """The base64 payload of an image `data:` URI (OpenAI's image_url, Responses' input_image). The server never
    fetches a URL: a remote one is refused, saying how to send the image instead."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise InvalidInput(
            f"{where}: remote image URLs are not fetched (localllm never downloads a URL a request names)",
            hint="send the image inline as a data: URI (data:image/png;base64,...)",
        )
    header, comma, payload = url.partition(",")
    if scheme != "data" or not comma or not header.lower().endswith(";base64"):
        raise InvalidInput(
            f"{where}: an image URL must be a base64 data: URI", hint="send data:image/png;base64,... (or jpeg, webp)"
        )
    return payload
