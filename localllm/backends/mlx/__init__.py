"""MLX backend: mlx + mlx-lm behind the same Protocol as llama.cpp (backends/base.py).

A loaded model is an MLX folder (config.json, safetensors, tokenizer files) read by `mlx_lm.load`. backend.py loads
it, meta.py reads its metadata and token spellings, model.py decodes, kv.py is the sequences' batched KV cache,
states.py saves and restores a sequence's part of it, sampling.py picks tokens.

Imported only when the MLX backend is chosen (backends/__init__.py turns an ImportError into the install hint)."""

from .backend import MlxBackend
from .model import MlxEmbedder, MlxModel
from .sampling import GRAMMAR_UNSUPPORTED, MlxSampler

__all__ = ["GRAMMAR_UNSUPPORTED", "MlxBackend", "MlxEmbedder", "MlxModel", "MlxSampler"]
