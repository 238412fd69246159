"""One Client interface for every surface: `LocalClient` runs in-process on the model pool and store, `HttpClient`
talks to a running `localllm serve`. Same methods, same api types, so the CLI, TUI and REST server never care which.

Streaming methods return iterators; closing an iterator early (generator close) cancels the request. An iterator that
is also `Cancellable` can be cancelled from another thread while it waits (the server does that when a client leaves
while its request is queued, since closing a generator that is running elsewhere is not allowed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO, Protocol, runtime_checkable

from ..api import (
    ChatChunk,
    ChatRequest,
    CreateRequest,
    EmbedRequest,
    EmbedResponse,
    GenerateChunk,
    GenerateRequest,
    ListResponse,
    ProcessResponse,
    PullProgress,
    RerankRequest,
    RerankResponse,
    ShowResponse,
)


@runtime_checkable
class Cancellable(Protocol):
    def cancel(self) -> None:
        """Stop the request from any thread: a queued one leaves the queue at once, a running one frees its slot,
        a template render stops; the iterator then ends."""


class Client(Protocol):
    def version(self) -> str: ...

    def list_models(self) -> ListResponse: ...

    def show(self, model: str, *, verbose: bool = False) -> ShowResponse:
        """`verbose` adds the token tables (tokenizer.ggml.tokens, merges, token_type) to model_info."""

    def has_blob(self, digest: str) -> bool:
        """Whether the store holds the blob (Ollama's HEAD /api/blobs/:digest)."""

    def add_blob(self, digest: str, source: BinaryIO) -> None:
        """Store uploaded bytes under `digest`, refusing bytes with another sha256 (POST /api/blobs/:digest)."""

    def pull(self, model: str) -> Iterator[PullProgress]: ...

    def create(self, request: CreateRequest) -> Iterator[PullProgress]: ...

    def copy(self, source: str, destination: str) -> None: ...

    def delete(self, model: str) -> None: ...

    def ps(self) -> ProcessResponse: ...

    def stop(self, model: str) -> None:
        """Unload a model now (Ollama: keep_alive 0)."""

    def generate(self, request: GenerateRequest) -> Iterator[GenerateChunk]: ...

    def chat(self, request: ChatRequest) -> Iterator[ChatChunk]: ...

    def generate_batch(self, requests: list[GenerateRequest]) -> Iterator[tuple[int, GenerateChunk]]:
        """Several generations of one model admitted together (OpenAI's n, prompt lists); each chunk is tagged with
        its request's index."""

    def chat_batch(self, requests: list[ChatRequest]) -> Iterator[tuple[int, ChatChunk]]:
        """As generate_batch, for chats."""

    def count_tokens(self, request: ChatRequest) -> int:
        """The prompt tokens `request` would take, the model's template applied (Anthropic's count_tokens)."""

    def embed(self, request: EmbedRequest) -> EmbedResponse: ...

    def rerank(self, request: RerankRequest) -> RerankResponse:
        """Each document's relevance to the query, best first (a reranker: a GGUF with rank pooling)."""

    def save_prompt_cache(self, request: ChatRequest) -> bytes:
        """The cached state of the conversation in `request` (its longest cached prefix), as a prompt-cache file's
        bytes (engine/prefix_cache.py's format)."""

    def load_prompt_cache(self, request: ChatRequest, data: bytes) -> int:
        """Pin a state from save_prompt_cache in the prefix cache of `request`'s model (loaded with its options);
        the number of tokens the state holds."""
