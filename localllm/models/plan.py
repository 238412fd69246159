"""The memory plan: what loading a model with given options will take, read from GGUF metadata before anything loads.

Weights are the file's tensor bytes. The KV cache is per slot and per token: K and V for every layer, each
n_head_kv x head_dim elements of the cache type (llama.cpp keeps sliding-window layers at full size too). The compute
buffer is dominated by the logits of a full micro-batch (n_batch x n_vocab floats), which is what llama.cpp reserves
on CPU; it is an estimate and labelled so.

A split GGUF's weights are all its parts (gguf.inspect_gguf reads them as one model); LoRA adapters add their own
tensors. Several models planned together count weights they share (the same files, the same weight options) once:
the backend loads them once and gives each model its own context."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..api import LoadOptions
from ..errors import ModelFormatError
from ..formats.gguf import GGUFInfo

# Bytes per cached element: f16 is 2; q8_0 and q4_0 store 32 values in 34 and 18 bytes.
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    adapters: int  # LoRA adapter tensors, per load
    kv_per_token: int  # one slot, one token
    kv_per_slot: int
    kv_total: int
    compute: int
    num_ctx: int
    num_parallel: int
    kv_type: str
    available: Optional[int]  # memory the OS reports as available now, when it can tell

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.kv_total + self.compute

    @property
    def fits(self) -> Optional[bool]:
        return None if self.available is None else self.total <= self.available


def plan_memory(info: GGUFInfo, load: LoadOptions, *, adapters: int = 0) -> MemoryPlan:
    """`load` must carry effective values (engine/pool.effective_load fills them from the environment); `adapters`
    is the bytes of the LoRA adapters' tensors (gguf.inspect_lora)."""
    n_ctx, slots, kv_type = load.num_ctx or 0, load.num_parallel or 1, load.kv_type or "f16"
    per_token = int(kv_elements_per_token(info) * KV_BYTES[kv_type])
    per_slot = per_token * n_ctx
    n_vocab = info.vocab_size or 0
    compute = load.num_batch * n_vocab * 4 + load.num_batch * (info.embedding_length or 0) * 4 * 4
    return MemoryPlan(weights=info.tensor_bytes, adapters=adapters, kv_per_token=per_token, kv_per_slot=per_slot,
                      kv_total=per_slot * slots, compute=compute, num_ctx=n_ctx, num_parallel=slots,
                      kv_type=kv_type, available=available_memory())


def weights_identity(path: Path, load: LoadOptions) -> tuple:
    """Loads with equal identities share one copy of the weights (as backends/llama_cpp.weights_key decides)."""
    return str(Path(path).absolute()), load.num_gpu, load.use_mmap


def total_with_shared_weights(plans: list[tuple[Any, MemoryPlan]]) -> int:
    """The memory of several loads at once: (weights identity, plan) pairs, each identity's weights counted once."""
    seen: set[Any] = set()
    total = 0
    for identity, plan in plans:
        total += plan.total - (plan.weights if identity in seen else 0)
        seen.add(identity)
    return total


def kv_elements_per_token(info: GGUFInfo) -> int:
    """K and V elements one token adds to one slot's cache, summed over layers."""
    arch, meta = info.architecture, info.metadata
    layers = info.block_count
    heads = _per_layer(meta.get(f"{arch}.attention.head_count"), layers)
    kv_heads = _per_layer(meta.get(f"{arch}.attention.head_count_kv", meta.get(f"{arch}.attention.head_count")),
                          layers)
    if not layers or not heads or not kv_heads or not info.embedding_length:
        raise ModelFormatError(f"{info.path} lacks the attention metadata a memory plan needs "
                               f"({arch}.block_count / attention.head_count)")
    key_len = meta.get(f"{arch}.attention.key_length") or info.embedding_length // max(heads)
    value_len = meta.get(f"{arch}.attention.value_length") or key_len
    return sum(kv * (key_len + value_len) for kv in kv_heads)


def _per_layer(value: Any, layers: Optional[int]) -> list[int]:
    if value is None or not layers:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
