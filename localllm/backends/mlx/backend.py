"""Loading an MLX folder: checks of the folder and the model's cache kinds, then mlx_lm.load."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ...api import LoadOptions, LoraAdapter
from ...errors import InvalidInput, ModelFormatError
from ...models.options import context_size
from ..base import LoadCheck
from .kv import KvQuant
from .model import MlxModel

log = logging.getLogger(__name__)


class MlxBackend:
    name = "mlx"

    def check(
        self, path: Path, options: LoadOptions, *, memory: Path, adapters: Sequence[LoraAdapter] = ()
    ) -> LoadCheck:
        return LoadCheck()  # mlx raises Python errors for bad weights: the load itself fails cleanly

    def placement(self, path: Path, options: LoadOptions) -> None:
        return None  # one device, unified memory: nothing to place

    def load(
        self,
        path: Path,
        options: LoadOptions,
        *,
        adapters: Sequence[LoraAdapter] = (),
        projector: Path | None = None,
    ) -> MlxModel:
        import mlx_lm

        n_seq, n_ctx = context_size(options)
        if projector is not None:
            raise InvalidInput(
                "vision projectors are not supported on the MLX backend",
                hint="run the model on llama.cpp (backend llama.cpp) with its GGUF weights",
            )
        if adapters:
            raise InvalidInput(
                "LoRA adapters are not supported on the MLX backend yet",
                hint="run the model on llama.cpp (backend llama.cpp) with its GGUF weights",
            )
        path = Path(path)
        _check_folder(path)
        try:
            # With return_config, mlx_lm.load returns the config too (its annotation says two values).
            model, tokenizer, config = cast(Any, mlx_lm.load)(str(path), return_config=True)
        except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"mlx-lm could not load the MLX folder {path}: {exc}") from None
        _prefer_float32_on_cpu(model)
        _check_cache_kinds(model, config)
        quant = kv_quant(options.kv_type, config)
        return MlxModel(path, model, tokenizer, config, n_seq=n_seq, n_ctx=n_ctx, kv_quant=quant)


KV_BITS = {"q8_0": 8, "q4_0": 4}  # kv_type -> mlx-lm's kv bits


def kv_quant(kv_type: str | None, config: dict) -> KvQuant | None:
    """mlx-lm's KV quantization for a kv_type: its default group of 64 elements, or 32 for smaller heads; None for
    f16 (the model's own float type) or where the head size takes neither group."""
    bits = KV_BITS.get(kv_type or "f16")
    if bits is None:
        return None
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    group = next((g for g in (64, 32) if head_dim % g == 0), None)
    if group is None:
        log.warning("kv_type %s needs heads of a multiple of 32 on MLX, not %d: kept unquantized", kv_type, head_dim)
        return None
    return KvQuant(bits=bits, group_size=group)


def _check_folder(path: Path) -> None:
    if path.is_file():
        raise ModelFormatError(
            f"{path} is a file; the MLX backend runs MLX model folders",
            hint="make an MLX copy with `localllm create NAME --from MODEL --format mlx`, "
            "or load it with backend llama.cpp",
        )
    if not path.is_dir():
        raise ModelFormatError(
            f"MLX model folder {path} does not exist",
            hint="an MLX model is a folder with config.json and *.safetensors",
        )
    missing = [
        name
        for name, ok in (
            ("config.json", (path / "config.json").is_file()),
            ("*.safetensors", any(path.glob("*.safetensors"))),
        )
        if not ok
    ]
    if missing:
        raise ModelFormatError(f"MLX model folder {path} has no {' or '.join(missing)}")


def float_bytes_on_load() -> int | None:
    """Bytes per element of the float weights once loaded: 4 on MLX's CPU build (cast to float32), None where they
    stay as stored. The memory plan reads it, so the plan and the load agree."""
    return 4 if mx.default_device().type == mx.cpu else None


def _prefer_float32_on_cpu(model) -> None:
    # MLX's CPU kernels are several times slower with fp16/bf16 (quantization scales too) than with f32; on Apple
    # GPUs half precision is the fast path, so only the CPU build is changed.
    if float_bytes_on_load() == 4:
        model.set_dtype(mx.float32)
        # Evaluate the casts now: a lazy array belongs to this thread's stream, and the engine thread that decodes
        # later cannot evaluate it ("There is no Stream(cpu, 0) in current thread").
        mx.eval(model.parameters())


def _check_cache_kinds(model, config: dict) -> None:
    # Trimming and prefix copies need caches that keep every position. Sliding-window layers are given full caches
    # (see MlxModel._new_cache); recurrent-state layers (Mamba-style) cannot be trimmed at all.
    kinds = {type(c) for c in make_prompt_cache(model)}
    if not kinds <= {KVCache, RotatingKVCache}:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise ModelFormatError(
            f"model type {config.get('model_type')!r} uses {names} caches, which the MLX backend "
            "cannot trim or share yet",
            hint="run a GGUF of this model on llama.cpp",
        )
