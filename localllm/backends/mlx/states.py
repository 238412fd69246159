"""The SequenceStates part on MLX: one sequence's keys and values, every layer, as bytes and back.

The bytes are a length-prefixed JSON header (positions, and each layer's arrays' shapes and dtypes: one array each for
keys and values, or three where the KV cache is quantized) and the arrays' raw bytes in that order. The prefix cache
signs and checks them like llama.cpp's (engine/prefix_cache.py); here a state is checked only to fit this load: the
same layers and arrays, and the positions it claims."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np

from ...errors import LocalLLMError
from .kv import Parts, SlotCache

_HEADER = struct.Struct("<I")  # the JSON header's byte length


class MlxStates:
    """Saves and restores rows of a SlotCache (engine thread only, as every cache operation)."""

    def __init__(self, cache: SlotCache):
        self._cache = cache

    def save_seq(self, seq: int) -> bytes | None:
        cache, n = self._cache, self._cache.lengths[seq]
        if n == 0:
            return None
        layers = [
            [tuple(mx.contiguous(a[seq : seq + 1, :, :n, :]) for a in parts or ()) for parts in (k, v)]
            for k, v in zip(cache.keys, cache.values)
        ]
        mx.eval(layers)
        header = {
            "n_tokens": n,
            "layers": [[[[list(a.shape), str(a.dtype)] for a in parts] for parts in layer] for layer in layers],
        }
        head = json.dumps(header).encode()
        arrays = (a for layer in layers for parts in layer for a in parts)
        return b"".join([_HEADER.pack(len(head)), head, *(_raw(a) for a in arrays)])

    def restore_seq(self, seq: int, data: bytes, n_tokens: int) -> None:
        cache = self._cache
        cache.trim(seq, 0)
        try:
            layers = _unpack(data, n_tokens, n_layers=len(cache.keys))
            for layer, (keys, values) in enumerate(layers):
                _check_fits(cache, layer, keys, values)
                cache.write(layer, seq, 0, keys, values)
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            cache.trim(seq, 0)
            raise LocalLLMError(f"a saved MLX state ({len(data):,} bytes) does not fit slot {seq}: {exc}") from None
        cache.lengths[seq] = n_tokens
        mx.eval(cache.arrays())


def _raw(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint8)).tobytes()  # through bytes: numpy has no bfloat16


def _check_fits(cache: SlotCache, layer: int, keys: Parts, values: Parts) -> None:
    """The state's arrays must be the kind this load writes: as many, of the same dtypes (a quantized cache's)."""
    want = 1 if cache.quant is None else 3  # an array, or mx.quantize's packed values, scales and biases
    for stored, parts in ((cache.keys[layer], keys), (cache.values[layer], values)):
        if len(parts) != want:
            raise ValueError(f"its layer {layer} has {len(parts)} arrays per cache; this load keeps {want}")
        if stored is not None and [a.dtype for a in stored] != [a.dtype for a in parts]:
            raise ValueError(f"its layer {layer} holds {[str(a.dtype) for a in parts]}")


def _unpack(data: bytes, n_tokens: int, *, n_layers: int) -> list[tuple[Parts, Parts]]:
    (size,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + size])
    if header["n_tokens"] != n_tokens:
        raise ValueError(f"it holds {header['n_tokens']} positions, not {n_tokens}")
    if len(header["layers"]) != n_layers:
        raise ValueError(f"it has {len(header['layers'])} layers; the model has {n_layers}")
    offset, layers = _HEADER.size + size, []
    for keys, values in header["layers"]:
        pair = []
        for described in (keys, values):
            parts = []
            for shape, dtype_name in described:
                dtype = getattr(mx, str(dtype_name).removeprefix("mlx.core."), None)
                if not isinstance(dtype, mx.Dtype):
                    raise ValueError(f"unknown dtype {dtype_name!r}")
                if len(shape) != 4 or shape[0] != 1 or shape[2] != n_tokens:
                    raise ValueError(f"a layer's shape {shape} is not one sequence of {n_tokens} positions")
                n_bytes = int(np.prod(shape)) * dtype.size
                chunk = np.frombuffer(data, np.uint8, count=n_bytes, offset=offset)
                parts.append(mx.array(chunk).view(dtype).reshape(shape))
                offset += n_bytes
            pair.append(tuple(parts))
        layers.append((pair[0], pair[1]))
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes follow the last layer")
    return layers
