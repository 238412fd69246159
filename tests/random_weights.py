"""Random weights for the synthetic GGUFs the tests write (rerank_model.py, vision_model.py)."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np


def weight_writers(
    writer: gguf.GGUFWriter, rng: np.random.Generator, n_embd: int
) -> tuple[Callable[..., None], Callable[[str], None]]:
    """(tensor(name, *shape, scale=None), norm(name)): add a random matrix, or a layer norm's weight and bias.

    A matrix's default scale, 1/sqrt(fan-in), keeps activations near unit size, so the float rounding of one batch
    shape or another stays far below what the tests compare (1e-4 for rerank scores, 1e-5 for image embeddings)."""

    def tensor(name: str, *shape: int, scale: float | None = None) -> None:
        std = scale if scale is not None else 1 / np.sqrt(shape[-1])
        writer.add_tensor(name, (rng.standard_normal(shape) * std).astype(np.float32))

    def norm(name: str) -> None:
        writer.add_tensor(f"{name}.weight", (1.0 + rng.standard_normal(n_embd) * 0.05).astype(np.float32))
        writer.add_tensor(f"{name}.bias", (rng.standard_normal(n_embd) * 0.05).astype(np.float32))

    return tensor, norm
