"""The sequences' KV cache as one batch, so that a forward pass can take rows of several sequences at once.

Each layer keeps keys and values of shape [n_seq, heads, capacity, head_dim]. Sequence s holds its positions
0..length[s]-1 at indices 0..length[s]-1 of row s: the rows are ragged (no left padding as in mlx-lm's BatchKVCache),
so each sequence grows, is trimmed or copied on its own, and a forward pass writes each row at its own offset and
masks each row to its own length. What lies past a row's length is garbage the mask never lets a query see."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

STEP = 256  # positions added to every row's capacity at a time (as mlx-lm's KVCache grows)


class SlotCache:
    """Keys and values of all sequences, layer by layer, and how many positions each sequence holds."""

    def __init__(self, n_layers: int, n_seq: int):
        self.lengths = [0] * n_seq
        self.keys: list[mx.array | None] = [None] * n_layers
        self.values: list[mx.array | None] = [None] * n_layers

    def step(self, seqs: Sequence[int], n_rows: int) -> list[StepLayer]:
        """The per-layer caches a model call takes for `n_rows` new rows in each of `seqs` (ascending, distinct);
        call advance() after it with how many of those rows were real."""
        step = Step(list(seqs), [self.lengths[s] for s in seqs], n_rows)
        return [StepLayer(self, layer, step) for layer in range(len(self.keys))]

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
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys is None or values is None or not n:
                continue
            keys[dst : dst + 1, :, :n, :] = keys[src : src + 1, :, :n, :]
            values[dst : dst + 1, :, :n, :] = values[src : src + 1, :, :n, :]
            self.keys[layer], self.values[layer] = keys, values
        self.lengths[dst] = n

    def arrays(self) -> list[mx.array]:
        """What to evaluate after a step, so no write stays pending into the next one."""
        return [a for a in (*self.keys, *self.values) if a is not None]

    def reserve(self, layer: int, like: mx.array, values_like: mx.array, end: int) -> None:
        """Grow `layer`'s buffers (shaped after the first keys and values written) to hold `end` positions."""
        keys = self.keys[layer]
        held = 0 if keys is None else keys.shape[2]
        if end <= held:
            return
        grow = -(-(end - held) // STEP) * STEP
        n_seq = len(self.lengths)
        new_k = mx.zeros((n_seq, like.shape[1], grow, like.shape[3]), like.dtype)
        new_v = mx.zeros((n_seq, values_like.shape[1], grow, values_like.shape[3]), values_like.dtype)
        old_v = self.values[layer]
        if keys is None or old_v is None:
            self.keys[layer], self.values[layer] = new_k, new_v
        else:
            self.keys[layer] = mx.concatenate([keys, new_k], axis=2)
            self.values[layer] = mx.concatenate([old_v, new_v], axis=2)


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

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        cache, layer, step = self._cache, self._layer, self._step
        cache.reserve(layer, keys, values, step.end)
        stored_k, stored_v = cache.keys[layer], cache.values[layer]
        assert stored_k is not None and stored_v is not None  # reserve() made them
        for b, (seq, start) in enumerate(zip(step.seqs, step.starts)):
            stored_k[seq : seq + 1, :, start : start + step.n_rows, :] = keys[b : b + 1]
            stored_v[seq : seq + 1, :, start : start + step.n_rows, :] = values[b : b + 1]
        cache.keys[layer], cache.values[layer] = stored_k, stored_v
        return step.rows(stored_k), step.rows(stored_v)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):  # noqa: N803
        return self._step.mask(window_size, return_array)
