"""The sequences' KV cache as one batch, so that a forward pass can take rows of several sequences at once.

Each layer keeps keys and values of shape [n_seq, heads, capacity, head_dim]. Sequence s holds its positions
0..length[s]-1 at indices 0..length[s]-1 of row s: the rows are ragged (no left padding as in mlx-lm's BatchKVCache),
so each sequence grows, is trimmed or copied on its own, and a forward pass writes each row at its own offset and
masks each row to its own length. What lies past a row's length is garbage the mask never lets a query see.

With a KV quantization (kv_type q8_0 / q4_0 as mlx-lm's kv bits) each of keys and values is the three arrays
mx.quantize gives (packed values, scales, biases), kept and cut alike; a layer's attention then takes them through
mlx-lm's quantized attention. Without, each is one array."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

STEP = 256  # positions added to every row's capacity at a time (as mlx-lm's KVCache grows)

Parts = tuple[mx.array, ...]  # keys (or values) of a layer: one array, or mx.quantize's three


@dataclass(frozen=True)
class KvQuant:
    """mlx-lm's KV quantization: bits per element, elements per scale and bias."""

    bits: int
    group_size: int


class SlotCache:
    """Keys and values of all sequences, layer by layer, and how many positions each sequence holds."""

    def __init__(self, n_layers: int, n_seq: int, *, quant: KvQuant | None = None):
        self.lengths = [0] * n_seq
        self.quant = quant
        self.keys: list[Parts | None] = [None] * n_layers
        self.values: list[Parts | None] = [None] * n_layers

    def step(self, seqs: Sequence[int], n_rows: int) -> list[StepLayer]:
        """The per-layer caches a model call takes for `n_rows` new rows in each of `seqs` (ascending, distinct);
        call advance() after it with how many of those rows were real."""
        step = Step(list(seqs), [self.lengths[s] for s in seqs], n_rows)
        kind = StepLayer if self.quant is None else QuantizedStepLayer
        return [kind(self, layer, step) for layer in range(len(self.keys))]

    def advance(self, seqs: Sequence[int], n_rows: Sequence[int]) -> None:
        for seq, n in zip(seqs, n_rows):
            self.lengths[seq] += n

    def trim(self, seq: int, n: int) -> None:
        """Keep the first `n` positions of `seq`."""
        self.lengths[seq] = min(n, self.lengths[seq])
        if not any(self.lengths):  # nothing held: give the buffers back instead of keeping them for reuse
            self.keys = [None] * len(self.keys)
            self.values = [None] * len(self.values)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make `dst` hold the first `n` positions of `src`. MLX arrays are values: later writes to `src` never show
        up in `dst`."""
        for parts in (*self.keys, *self.values):
            for a in parts or ():
                if n:
                    a[dst : dst + 1, :, :n, :] = a[src : src + 1, :, :n, :]
        self.lengths[dst] = n

    def arrays(self) -> list[mx.array]:
        """What to evaluate after a step, so no write stays pending into the next one."""
        return [a for parts in (*self.keys, *self.values) for a in parts or ()]

    def encode(self, x: mx.array) -> Parts:
        """New keys or values [B, heads, n, dim] as this cache stores them."""
        if self.quant is None:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.quant.group_size, bits=self.quant.bits))

    def write(self, layer: int, seq: int, start: int, keys: Parts, values: Parts) -> None:
        """Store one sequence's encoded keys and values ([1, heads, n, ...] each) from position `start` on."""
        n = keys[0].shape[2]
        self.reserve(layer, keys, values, start + n)
        for stored, new in ((self.keys[layer], keys), (self.values[layer], values)):
            for a, part in zip(stored or (), new):
                a[seq : seq + 1, :, start : start + n, :] = part

    def reserve(self, layer: int, keys: Parts, values: Parts, end: int) -> None:
        """Grow `layer`'s buffers (shaped after the first keys and values written) to hold `end` positions."""
        stored = self.keys[layer]
        held = 0 if stored is None else stored[0].shape[2]
        if end <= held:
            return
        grow = -(-(end - held) // STEP) * STEP
        self.keys[layer] = _grown(stored, keys, len(self.lengths), grow)
        self.values[layer] = _grown(self.values[layer], values, len(self.lengths), grow)


def _grown(stored: Parts | None, like: Parts, n_seq: int, grow: int) -> Parts:
    new = tuple(mx.zeros((n_seq, a.shape[1], grow, a.shape[3]), a.dtype) for a in like)
    if stored is None:
        return new
    return tuple(mx.concatenate([old, more], axis=2) for old, more in zip(stored, new))


class Step:
    """One forward pass: which sequences, where each starts, how many rows each gets (padded to the same count)."""

    def __init__(self, seqs: list[int], starts: list[int], n_rows: int):
        self.seqs, self.starts, self.n_rows = seqs, starts, n_rows
        self.end = max(starts) + n_rows  # keys the pass attends over: the longest row's
        lo = seqs[0]
        self.contiguous = seqs == list(range(lo, lo + len(seqs)))
        self.offset: int | mx.array = starts[0] if len(seqs) == 1 else mx.array(starts)

    def rows(self, buffer: mx.array) -> mx.array:
        """The step's rows of a layer buffer, up to the longest row's end."""
        if self.contiguous:
            return buffer[self.seqs[0] : self.seqs[0] + len(self.seqs), :, : self.end, :]
        return mx.take(buffer[:, :, : self.end, :], mx.array(self.seqs), axis=0)

    def mask(self, window_size: int | None, return_array: bool) -> mx.array | str | None:
        if len(self.seqs) == 1:  # keys end exactly where the queries do: mlx-lm's own causal mask
            return create_attention_mask(self.n_rows, self.starts[0], return_array, window_size)
        # Query j of row b sits at starts[b] + j and sees keys 0..starts[b] + j (within the window, if any).
        queries = mx.array(self.starts)[:, None] + mx.arange(self.n_rows)[None]  # [B, L]
        keys = mx.arange(self.end)
        seen = keys[None, None] <= queries[..., None]  # [B, L, S]
        if window_size is not None:
            seen = seen & (queries[..., None] - keys[None, None] < window_size)
        return seen[:, None]  # [B, 1, L, S]: one mask for every head


class StepLayer:
    """What one layer's attention sees as its cache during a Step (mlx-lm's cache interface: offset,
    update_and_fetch, make_mask)."""

    def __init__(self, cache: SlotCache, layer: int, step: Step):
        self._cache, self._layer, self._step = cache, layer, step
        self.offset = step.offset  # RoPE positions: one per row where rows start apart

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        cache, layer, step = self._cache, self._layer, self._step
        new_k, new_v = cache.encode(keys), cache.encode(values)
        for b, (seq, start) in enumerate(zip(step.seqs, step.starts)):
            row = slice(b, b + 1)
            cache.write(layer, seq, start, tuple(a[row] for a in new_k), tuple(a[row] for a in new_v))
        stored_k, stored_v = cache.keys[layer], cache.values[layer]
        assert stored_k is not None and stored_v is not None  # write() made them
        return self._fetched(tuple(step.rows(a) for a in stored_k), tuple(step.rows(a) for a in stored_v))

    def _fetched(self, keys: Parts, values: Parts):
        return keys[0], values[0]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):  # noqa: N803
        return self._step.mask(window_size, return_array)


class QuantizedStepLayer(StepLayer):
    """A step's layer over quantized keys and values: mlx-lm's attention sees `bits` and takes the three arrays."""

    def __init__(self, cache: SlotCache, layer: int, step: Step):
        super().__init__(cache, layer, step)
        assert cache.quant is not None
        self.bits, self.group_size = cache.quant.bits, cache.quant.group_size

    def _fetched(self, keys: Parts, values: Parts):
        return keys, values
