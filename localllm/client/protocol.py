"""One Client interface for every surface: `LocalClient` runs in-process on the model pool and store, `HttpClient`
talks to a running `localllm serve`. Same methods, same api types, so the CLI, TUI and REST server never care which.

Streaming methods return a RequestStream: iterate it on one thread; `close()` it there when done early (it cancels the
request), or `cancel()` it from any other thread while it waits (the server does that when a client leaves while its
request is queued, since closing a generator that is running elsewhere is not allowed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TypeVar

from ..api import (
    ChatChunk,
    ChatRequest,
    CreateRequest,
    EmbedRequest,
    EmbedResponse,
    GenerateChunk,
    GenerateRequest,
    ListResponse,
    PlanRequest,
    PlanResponse,
    ProcessResponse,
    PullProgress,
    RerankRequest,
    RerankResponse,
    ShowResponse,
)

T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Admission:
    """The model's engine has taken a request, so the errors of its input are behind it: its prompt's tokens, and
    those the prefix cache serves (None while it waits for a slot). A server opens its stream here, before the
    prefill, rather than at the first token."""

    prompt_tokens: int
    cached_tokens: int | None


class RequestStream(Iterator[T_co], Protocol[T_co]):
    """A request's chunks, as every streaming Client method returns them."""

    def __next__(self) -> T_co: ...

    def close(self) -> None:
        """Done with it, on the thread that iterates: a request still running is cancelled and its resources (the
        slot, the connection) are given back. Safe to call twice and after the end."""

    def cancel(self) -> None:
        """Stop the request from any thread: a queued one leaves the queue at once, a running one frees its slot,
        a template render stops; the iterator then ends. A pull or create stops at its next chunk."""

    def on_admitted(self, hook: Callable[[Admission], None]) -> None:
        """Call `hook` once, on the thread that iterates, when the engine has taken the request (before its first
        chunk). Streams with no engine of ours behind them (a pull, a remote server's answer) never call it."""


class Client(Protocol):
    def version(self) -> str: ...

    def list_models(self) -> ListResponse: ...

    def show(self, model: str, *, verbose: bool = False) -> ShowResponse:
        """`verbose` adds the token tables (tokenizer.ggml.tokens, merges, token_type) to model_info."""

    def has_blob(self, digest: str) -> bool:
        """Whether the store holds the blob (Ollama's HEAD /api/blobs/:digest)."""

    def add_blob(self, digest: str, source: BinaryIO) -> None:
        """Store uploaded bytes under `digest`, refusing bytes with another sha256 (POST /api/blobs/:digest)."""

    def pull(self, model: str) -> RequestStream[PullProgress]: ...

    def create(self, request: CreateRequest) -> RequestStream[PullProgress]: ...

    def copy(self, source: str, destination: str) -> None: ...

    def delete(self, model: str) -> None: ...

    def ps(self) -> ProcessResponse: ...

    def stop(self, model: str) -> None:
        """Unload a model now (Ollama: keep_alive 0)."""

    def plan(self, request: PlanRequest) -> PlanResponse:
        """The memory a load of the model (and its draft model) with these options would take, and where its layers
        would go, by the devices' free memory now; nothing loads."""

    def generate(self, request: GenerateRequest) -> RequestStream[GenerateChunk]: ...

    def chat(self, request: ChatRequest) -> RequestStream[ChatChunk]: ...

    def generate_batch(self, requests: list[GenerateRequest]) -> RequestStream[tuple[int, GenerateChunk]]:
        """Several generations of one model admitted together (OpenAI's n, prompt lists); each chunk is tagged with
        its request's index."""

    def chat_batch(self, requests: list[ChatRequest]) -> RequestStream[tuple[int, ChatChunk]]:
        """As generate_batch, for chats."""

    def count_tokens(self, request: ChatRequest) -> int:
        """The prompt tokens `request` would take, the model's template applied (Anthropic's count_tokens)."""

    def embed(self, request: EmbedRequest, cancelled: Callable[[], bool] = ...) -> EmbedResponse:
        """The inputs' vectors; the work stops (Cancelled) once `cancelled()` turns true, as when the client left."""

    def rerank(self, request: RerankRequest) -> RerankResponse:
        """Each document's relevance to the query, best first (a reranker: a GGUF with rank pooling)."""

    def save_prompt_cache(self, request: ChatRequest) -> bytes:
        """The cached state of the conversation in `request` (its longest cached prefix), as a prompt-cache file's
        bytes (engine/prefix_cache.py's format)."""

    def load_prompt_cache(self, request: ChatRequest, data: bytes) -> int:
        """Pin a state from save_prompt_cache in the prefix cache of `request`'s model (loaded with its options);
        the number of tokens the state holds."""

    def close(self) -> None:
        """Give back what the client holds: LocalClient unloads its models, HttpClient closes its connections."""
