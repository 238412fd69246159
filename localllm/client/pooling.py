"""Pooled outputs, not generations: embeddings (/api/embed, /v1/embeddings) and reranking (/rerank). Their inputs
are checked and tokenized here, scored by the engine, and shaped into the api's responses. Every input is bounded
before it is tokenized: its count (as OpenAI caps embedding inputs and rerank caps documents) and its size (what the
context could ever hold, prompts.check_text_size)."""

from __future__ import annotations

import math
from collections.abc import Callable

from .. import api
from ..engine.runner import ModelEngine
from ..errors import ContextOverflow, InvalidInput
from .prompts import check_text_size, checked_tokens


def check_embed_inputs(request: api.EmbedRequest) -> None:
    """Refuse more inputs than one request may embed, before the model is loaded for them."""
    count = len(request.input_tokens) if request.input_tokens is not None else len(request.input)
    if not isinstance(request.input, str) and count > api.MAX_EMBED_INPUTS:
        raise InvalidInput(
            f"the request holds {count:,} inputs; the limit is {api.MAX_EMBED_INPUTS:,} per request",
            hint="send the inputs in several requests",
        )


def embed_vectors(
    engine: ModelEngine,
    request: api.EmbedRequest,
    tokenize: Callable[[str], list[int]],
    cancelled: Callable[[], bool] = lambda: False,
    n_ctx: int | None = None,
) -> tuple[list[list[float]], list[list[int]]]:
    """The request's vectors and the token lists they were pooled from, each within `n_ctx` (the request's own
    context; the engine's by default); Cancelled once `cancelled()` turns true."""
    tokenized = _embed_inputs(engine, request, tokenize, n_ctx or engine.n_ctx)
    vectors = engine.embed(tokenized, cancelled) if tokenized else []
    if request.dimensions is not None:
        vectors = [_shorten(vector, request.dimensions) for vector in vectors]
    return vectors, tokenized


def _embed_inputs(
    engine: ModelEngine, request: api.EmbedRequest, tokenize: Callable[[str], list[int]], n_ctx: int
) -> list[list[int]]:
    """The inputs as token lists. Ollama: "" or [] embeds nothing (the model is loaded: clients preload so)."""
    if request.input_tokens is not None:
        return [
            _fit_embed(checked_tokens(tokens, engine.meta.n_vocab, f"input {i}"), request.truncate, n_ctx)
            for i, tokens in enumerate(request.input_tokens)
        ]
    texts = [request.input] if isinstance(request.input, str) else list(request.input)
    if texts == [""]:
        return []
    for i, text in enumerate(texts):
        if not text:
            raise InvalidInput(f"input {i} is an empty string", hint="embed non-empty texts")
        check_text_size(len(text), n_ctx, f"input {i}")
    return [_fit_embed(tokenize(text), request.truncate, n_ctx) for text in texts]


def _fit_embed(tokens: list[int], truncate: bool, limit: int) -> list[int]:
    if not tokens:
        raise InvalidInput("an input is empty", hint="embed at least one token")
    if len(tokens) > limit:
        if not truncate:
            raise ContextOverflow(prompt_tokens=len(tokens), num_ctx=limit)
        tokens = tokens[:limit]
    return tokens


def _shorten(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` values, scaled back to unit length (Ollama's and OpenAI's `dimensions`)."""
    if dimensions > len(vector):
        raise InvalidInput(
            f"dimensions {dimensions} is more than the model's {len(vector)}", hint=f"ask for at most {len(vector)}"
        )
    head = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in head))
    return [v / norm for v in head] if norm > 0 else head


def check_rerank_texts(request: api.RerankRequest) -> None:
    """Refuse what llama.cpp would score as nothing: an empty query, no documents, an empty document."""
    if not request.query:
        raise InvalidInput("query is empty", hint="send the text the documents are ranked against")
    if not request.documents:
        raise InvalidInput("documents is empty", hint="send at least one document to rank")
    for i, document in enumerate(request.documents):
        if not document:
            raise InvalidInput(f"document {i} is an empty string", hint="rank non-empty texts")


def rerank_pairs(engine: ModelEngine, request: api.RerankRequest, n_ctx: int | None = None) -> list[list[int]]:
    """Each document's pair with the query as the reranker reads it, each within the request's context (`n_ctx`;
    the engine's by default), as llama-server refuses a longer pair rather than cut it."""
    if not engine.meta.reranker:
        raise InvalidInput(
            f"model {request.model!r} does not rerank: it has no classifier head (rank pooling)",
            hint="rerank with a cross-encoder GGUF (e.g. bge-reranker-v2-m3); /v1/embeddings embeds texts",
        )
    limit = n_ctx or engine.n_ctx
    pairs = []
    for i, document in enumerate(request.documents):
        check_text_size(len(request.query) + len(document), limit, f"document {i} with the query")
        tokens = engine.pair_tokens(request.query, document)
        if len(tokens) > limit:
            raise InvalidInput(
                f"document {i} with the query is {len(tokens)} tokens but the context holds {limit}",
                hint="shorten the document or the query, or raise num_ctx up to the model's trained context",
            )
        pairs.append(tokens)
    return pairs


def rerank_response(request: api.RerankRequest, pairs: list[list[int]], scores: list[float]) -> api.RerankResponse:
    """The documents best first (top_n of them), and the tokens the pairs took."""
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n]
    used = sum(map(len, pairs))
    return api.RerankResponse(
        model=request.model,
        usage=api.RerankUsage(prompt_tokens=used, total_tokens=used),
        results=[_rerank_result(request, i, scores[i]) for i in ranked],
    )


def _rerank_result(request: api.RerankRequest, index: int, score: float) -> api.RerankResult:
    document = api.RerankDocument(text=request.documents[index]) if request.return_documents else None
    return api.RerankResult(index=index, relevance_score=score, document=document)
