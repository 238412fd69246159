"""A vision projector through llama.cpp's mtmd (tools/mtmd): images in, embedding rows for the text model out.

mtmd_tokenize lays an image out as the text tokens its projector wraps it in plus one image chunk; our prompt holds
that chunk as placeholder ids (negative, from the image's digest), so the scheduler and the prefix cache treat it like
text. Before a decode whose rows hold placeholders, the engine thread encodes the image (mtmd_encode_chunk) and the
decode reads the rows from here. mtmd is given RGB pixels only (mtmd_bitmap_init): it never parses a file itself.

Projectors whose images need non-causal attention (gemma3) or M-RoPE positions (Qwen2-VL) are refused: their rows
cannot be decoded as ordinary positions in a shared batch."""

from __future__ import annotations

import ctypes
import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import mtmd_cpp

from ...errors import InvalidInput, LocalLLMError, ModelFormatError
from ...media import ImagePixels, PromptImage

MTMD_INPUT_CHUNK_TYPE_IMAGE = 1
KEPT_IMAGES = 32  # encoded images kept at hand: a step needs at most one run per slot
_PLACEHOLDER_SPAN = 2**31 - 1  # placeholders fill the negative int32 range (the prefix cache stores int32 tokens)


def placeholders(key: bytes, n: int) -> tuple[int, ...]:
    """n placeholder ids for an image: each position's own 31-bit hash, so that two images share a placeholder at one
    position with a chance of 2^-31, and never a run of them."""
    return tuple(
        -1
        - int.from_bytes(hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=4).digest(), "little")
        % _PLACEHOLDER_SPAN
        for i in range(n)
    )


class Projector:
    """The Vision part of a load with a projector: mtmd's context over the text model, and the embeddings of the images
    encoded last."""

    def __init__(self, path: Path, model, *, n_threads: int, n_embd: int):
        params = mtmd_cpp.mtmd_context_params_default()
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        ctx = mtmd_cpp.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            raise ModelFormatError(f"llama.cpp's mtmd could not load the vision projector {path}")
        self._ctx = ctx
        if not mtmd_cpp.mtmd_support_vision(ctx):
            self.close()
            raise ModelFormatError(f"the projector {path} reads no images (an audio projector?)")
        if mtmd_cpp.mtmd_decode_use_mrope(ctx):
            self.close()
            raise ModelFormatError(
                f"the projector {path} places images with M-RoPE positions (the Qwen2-VL family), "
                "which localllm does not support yet"
            )
        self._marker = mtmd_cpp.mtmd_default_marker()
        self._n_embd = n_embd
        # The projector's identity is in every placeholder: the same image under another projector differs.
        self._key = f"{path.name}:{path.stat().st_size}:".encode()
        self._images: OrderedDict[str, tuple[tuple[int, ...], np.ndarray]] = OrderedDict()
        self._rows: dict[int, tuple[np.ndarray, int]] = {}

    def image_tokens(self, image: ImagePixels) -> list[int]:
        """The image's prompt piece. mtmd_tokenize only reads the context (llama-server calls it from its HTTP
        threads too), so any thread may ask."""
        piece: list[int] = []
        with self._chunks(image) as chunks:
            for chunk in chunks:
                if not _is_image(chunk):
                    piece += self._wrapper_tokens(chunk)
                else:  # a sliced image is several chunks (an overview and tiles): each has placeholders of its own
                    piece += self._placeholders(image, len(piece), self._image_size(chunk))
        return piece

    def encode_image(self, image: PromptImage) -> None:
        """Encode the image on the engine thread, unless its embeddings are still at hand."""
        digest = image.pixels.digest
        if digest in self._images:
            self._images.move_to_end(digest)
            return
        with self._chunks(image.pixels) as chunks:
            parts = [self._encode_chunk(c) for c in chunks if _is_image(c)]
        rows = np.concatenate(parts)
        if len(rows) != len(image.placeholders):
            raise LocalLLMError(
                f"the image takes {len(rows)} positions, but its prompt holds {len(image.placeholders)}"
            )
        self._keep(digest, image.placeholders, rows)

    def _encode_chunk(self, chunk) -> np.ndarray:
        n = mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk)
        status = mtmd_cpp.mtmd_encode_chunk(self._ctx, chunk)
        if status != 0:
            raise LocalLLMError(f"mtmd could not encode the image (status {status})")
        out = mtmd_cpp.mtmd_get_output_embd(self._ctx)
        return np.ctypeslib.as_array(out, shape=(n * self._n_embd,)).reshape(n, self._n_embd).copy()

    def rows(self, tokens: list[int]) -> np.ndarray:
        """The embeddings of placeholder `tokens`, one row each (float32, C order)."""
        try:
            return np.stack([rows[i] for rows, i in (self._rows[t] for t in tokens)])
        except KeyError:
            raise LocalLLMError("a batch row holds an image placeholder whose image was not encoded") from None

    def close(self) -> None:
        if self._ctx is not None:
            mtmd_cpp.mtmd_free(self._ctx)
            self._ctx = None
        self._images.clear()
        self._rows.clear()

    def _keep(self, digest: str, ids: tuple[int, ...], rows: np.ndarray) -> None:
        self._images[digest] = (ids, rows)
        self._rows.update((token, (rows, i)) for i, token in enumerate(ids))
        while len(self._images) > KEPT_IMAGES:
            _, (old, _) = self._images.popitem(last=False)
            for token in old:
                self._rows.pop(token, None)

    def _placeholders(self, image: ImagePixels, offset: int, n: int) -> tuple[int, ...]:
        """Placeholders of the image chunk that starts `offset` tokens into the image's piece."""
        return placeholders(self._key + f"{image.digest}:{offset}:".encode(), n)

    @staticmethod
    def _wrapper_tokens(chunk) -> list[int]:
        tokens = _text_tokens(chunk)
        if any(t < 0 for t in tokens):  # mtmd looked up a special token the text model's vocabulary lacks
            raise InvalidInput(
                "the vision projector wraps images in special tokens this model's vocabulary lacks",
                hint="the projector belongs to another model: use the one published beside these weights",
            )
        return tokens

    def _image_size(self, chunk) -> int:
        if mtmd_cpp.mtmd_decode_use_non_causal(self._ctx, chunk):
            raise InvalidInput(
                "this model's projector reads images with non-causal attention, which localllm does not support yet"
            )
        n, n_pos = mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk), mtmd_cpp.mtmd_input_chunk_get_n_pos(chunk)
        if n != n_pos:
            raise InvalidInput(f"this model's projector places {n} image embeddings on {n_pos} positions")
        return int(n)

    @contextmanager
    def _chunks(self, image: ImagePixels) -> Iterator[list]:
        """mtmd's chunks for the image alone (the marker as the whole text), freed on the way out."""
        data = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
        bitmap = mtmd_cpp.mtmd_bitmap_init(image.width, image.height, data)
        if not bitmap:
            raise LocalLLMError(f"mtmd could not take a {image.width}x{image.height} image")
        chunks = mtmd_cpp.mtmd_input_chunks_init()
        try:
            text = mtmd_cpp.mtmd_input_text()
            text.text, text.text_len = self._marker, len(self._marker)
            text.add_special, text.parse_special = False, True
            bitmaps = (mtmd_cpp.mtmd_bitmap_p_ctypes * 1)(bitmap)
            status = mtmd_cpp.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if status != 0:
                raise InvalidInput(f"the projector could not read the {image.width}x{image.height} image")
            yield [mtmd_cpp.mtmd_input_chunks_get(chunks, i) for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks))]
        finally:
            mtmd_cpp.mtmd_input_chunks_free(chunks)
            mtmd_cpp.mtmd_bitmap_free(bitmap)


def _is_image(chunk) -> bool:
    return mtmd_cpp.mtmd_input_chunk_get_type(chunk) == MTMD_INPUT_CHUNK_TYPE_IMAGE


def _text_tokens(chunk) -> list[int]:
    n = ctypes.c_size_t()
    ptr = mtmd_cpp.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
    return [int(ptr[i]) for i in range(n.value)]


def decode_rows(ctx, batch, rows: np.ndarray, positions: list[int], seqs: list[int]) -> int:
    """llama_decode of embedding rows (a batch made with embd = n_embd): no row asks for logits."""
    n, n_embd = rows.shape
    ctypes.memmove(batch.embd, np.ascontiguousarray(rows, dtype=np.float32).ctypes.data, n * n_embd * 4)
    batch.n_tokens = n
    for i in range(n):
        batch.pos[i] = positions[i]
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seqs[i]
        batch.logits[i] = 0
    return int(llama_cpp.llama_decode(ctx, batch))
