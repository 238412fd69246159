"""One Client interface for every surface: `LocalClient` runs in-process on the model pool and store, `HttpClient`
talks to a running `localllm serve`. Same methods, same api types, so the CLI, TUI and REST server never care which.

Streaming methods return iterators; closing an iterator early (generator close) cancels the request. An iterator that
is also `Cancellable` can be cancelled from another thread while it waits (the server does that when a client leaves
while its request is queued, since closing a generator that is running elsewhere is not allowed)."""

from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

from ..api import (ChatChunk, ChatRequest, CreateRequest, EmbedRequest, EmbedResponse, GenerateChunk,
                  GenerateRequest, ListResponse, ProcessResponse, PullProgress, ShowResponse)


@runtime_checkable
class Cancellable(Protocol):
    def cancel(self) -> None:
        """Stop the request from any thread: a queued one leaves the queue at once, a running one frees its slot,
        a template render stops; the iterator then ends."""


class Client(Protocol):
    def version(self) -> str: ...

    def list_models(self) -> ListResponse: ...

    def show(self, model: str) -> ShowResponse: ...

    def pull(self, model: str) -> Iterator[PullProgress]: ...

    def create(self, request: CreateRequest) -> Iterator[PullProgress]: ...

    def copy(self, source: str, destination: str) -> None: ...

    def delete(self, model: str) -> None: ...

    def ps(self) -> ProcessResponse: ...

    def stop(self, model: str) -> None:
        """Unload a model now (Ollama: keep_alive 0)."""

    def generate(self, request: GenerateRequest) -> Iterator[GenerateChunk]: ...

    def chat(self, request: ChatRequest) -> Iterator[ChatChunk]: ...

    def embed(self, request: EmbedRequest) -> EmbedResponse: ...
