"""The SequenceStates part on MLX: one sequence's keys and values, every layer, as bytes and back.

The bytes are a length-prefixed JSON header (positions, layer count, dtype, each layer's key and value shapes) and
the arrays' raw bytes in layer order. The prefix cache signs and checks them like llama.cpp's (engine/prefix_cache.py);
here a state is checked only to fit this load: same layers, same float type, the positions it claims."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np

from ...errors import LocalLLMError
from .kv import SlotCache

_HEADER = struct.Struct("<I")  # the JSON header's byte length


class MlxStates:
    """Saves and restores rows of a SlotCache (engine thread only, as every cache operation)."""

    def __init__(self, cache: SlotCache):
        self._cache = cache

    def save_seq(self, seq: int) -> bytes | None:
        cache, n = self._cache, self._cache.lengths[seq]
        if n == 0 or any(k is None for k in cache.keys):
            return None
        layers = [
            (mx.contiguous(k[seq : seq + 1, :, :n, :]), mx.contiguous(v[seq : seq + 1, :, :n, :]))
            for k, v in zip(cache.keys, cache.values)
            if k is not None and v is not None
        ]
        mx.eval(layers)
        header = {
            "n_tokens": n,
            "dtype": str(layers[0][0].dtype),
            "shapes": [[list(k.shape), list(v.shape)] for k, v in layers],
        }
        head = json.dumps(header).encode()
        return b"".join([_HEADER.pack(len(head)), head, *(_raw(a) for layer in layers for a in layer)])

    def restore_seq(self, seq: int, data: bytes, n_tokens: int) -> None:
        cache = self._cache
        cache.trim(seq, 0)
        try:
            layers = _unpack(data, n_tokens, n_layers=len(cache.keys))
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise LocalLLMError(f"a saved MLX state ({len(data):,} bytes) does not fit slot {seq}: {exc}") from None
        for layer, (keys, values) in enumerate(layers):
            cache.reserve(layer, keys, values, n_tokens)
            stored_k, stored_v = cache.keys[layer], cache.values[layer]
            assert stored_k is not None and stored_v is not None  # reserve() made them
            if stored_k.dtype != keys.dtype:
                cache.trim(seq, 0)
                raise LocalLLMError(f"a saved MLX state holds {keys.dtype} keys; this load keeps {stored_k.dtype}")
            stored_k[seq : seq + 1, :, :n_tokens, :] = keys
            stored_v[seq : seq + 1, :, :n_tokens, :] = values
        cache.lengths[seq] = n_tokens
        mx.eval(cache.arrays())


def _raw(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint8)).tobytes()  # through bytes: numpy has no bfloat16


def _unpack(data: bytes, n_tokens: int, *, n_layers: int) -> list[tuple[mx.array, mx.array]]:
    (size,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + size])
    if header["n_tokens"] != n_tokens:
        raise ValueError(f"it holds {header['n_tokens']} positions, not {n_tokens}")
    if len(header["shapes"]) != n_layers:
        raise ValueError(f"it has {len(header['shapes'])} layers; the model has {n_layers}")
    dtype = getattr(mx, header["dtype"].removeprefix("mlx.core."))
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"unknown dtype {header['dtype']!r}")
    offset, layers = _HEADER.size + size, []
    for shapes in header["shapes"]:
        pair = []
        for shape in shapes:
            if len(shape) != 4 or shape[0] != 1 or shape[2] != n_tokens:
                raise ValueError(f"a layer's shape {shape} is not one sequence of {n_tokens} positions")
            n_bytes = int(np.prod(shape)) * dtype.size
            chunk = np.frombuffer(data, np.uint8, count=n_bytes, offset=offset)
            pair.append(mx.array(chunk).view(dtype).reshape(shape))
            offset += n_bytes
        layers.append((pair[0], pair[1]))
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes follow the last layer")
    return layers
