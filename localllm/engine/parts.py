"""A loaded model's optional parts as the engine asks for them: the part, or the InvalidInput a user sees when a
request needs a capability this load lacks (backends/base.py lists the parts)."""

from __future__ import annotations

from ..backends.base import Embedder, LoadedModel, Reranker, Vision
from ..errors import InvalidInput


def vision_of(model: LoadedModel) -> Vision:
    if model.vision is None:
        # Ollama's wording (model/model.go ErrNoVisionModel), which clients match on.
        raise InvalidInput(
            "this model is missing data required for image input",
            hint="use a model with a vision projector (`localllm show` lists vision among its capabilities)",
        )
    return model.vision


def embedder_of(model: LoadedModel) -> Embedder:
    if model.embedder is None:
        if model.meta.reranker:
            raise InvalidInput("this model is a reranker: it scores query/document pairs and does not embed texts")
        raise InvalidInput(f"embeddings are not supported on this backend for {model.meta.architecture} models")
    return model.embedder


def reranker_of(model: LoadedModel) -> Reranker:
    if model.reranker is None:
        raise InvalidInput(
            "this model does not rerank: it has no classifier head (rank pooling)",
            hint="rerank with a cross-encoder GGUF such as bge-reranker-v2-m3",
        )
    return model.reranker
