"""The Client over HTTP: the same methods and api types as LocalClient, spoken to a running `localllm serve` through
the Ollama-native REST API (so it also works against Ollama itself).

Streams are NDJSON read line by line; closing a stream early, or cancelling it from another thread, closes its
response (the connection), which the server takes as a cancel. HTTP errors become the errors.* class of their status
with the server's message; a refused connection is ServerUnreachable naming the address."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, TypeVar

import httpx
from pydantic import BaseModel

from .. import api, config
from ..errors import (
    BackendUnavailable,
    Cancelled,
    Forbidden,
    InvalidInput,
    LocalLLMError,
    ModelNotFound,
    NetworkError,
    PayloadTooLarge,
    QueueFull,
    ServerUnreachable,
    Unauthorized,
)
from .protocol import RequestStream
from .streams import CancelToken, TokenStream

M = TypeVar("M", bound=BaseModel)

# No read timeout: a request may wait for a model load or a slot for a long time before its first byte.
DEFAULT_TIMEOUT = httpx.Timeout(10.0, read=None)

_ERRORS_BY_STATUS: dict[int, type[LocalLLMError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: ModelNotFound,
    413: PayloadTooLarge,
    499: Cancelled,
    501: BackendUnavailable,
    502: NetworkError,
    503: QueueFull,
}


def normalize_url(base_url: str | None) -> str:
    url = (base_url or config.base_url()).rstrip("/")
    return url if "://" in url else f"http://{url}"


def error_for(response: httpx.Response) -> LocalLLMError:
    """The errors.* instance for an error response, carrying the server's own message."""
    try:
        message = str(response.json().get("error") or response.text)
    except (ValueError, AttributeError):
        message = response.text or response.reason_phrase
    kind = _ERRORS_BY_STATUS.get(response.status_code, LocalLLMError)
    exc = kind(message or f"HTTP {response.status_code}")
    if isinstance(exc, QueueFull) and response.headers.get("retry-after", "").isdigit():
        exc.retry_after = int(response.headers["retry-after"])
    return exc


def server_running(base_url: str | None = None) -> bool:
    """True when something answers `GET /` with 200 at the address (default: LOCALLLM_HOST)."""
    try:
        return httpx.get(normalize_url(base_url) + "/", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class HttpClient:
    """Client over a running server. Use as a context manager, or call close()."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
    ):
        self.base_url = normalize_url(base_url)
        key = config.API_KEY.get() if api_key is None else api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------- transport

    @contextmanager
    def _reaching_server(self) -> Iterator[None]:
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnreachable(
                f"no localllm server answers at {self.base_url} ({exc})",
                hint="start one with `localllm serve`, or set LOCALLLM_HOST",
            ) from None
        except httpx.TransportError as exc:
            raise ServerUnreachable(
                f"lost the connection to the server at {self.base_url}: {exc!r}",
                hint="is `localllm serve` still running?",
            ) from None

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        with self._reaching_server():
            response = self._http.request(method, path, json=body)
        if response.status_code >= 400:
            raise error_for(response)
        return response

    def _get(self, path: str, kind: type[M]) -> M:
        return kind.model_validate(self._call("GET", path).json())

    def _post(self, path: str, body: dict, kind: type[M]) -> M:
        return kind.model_validate(self._call("POST", path, body).json())

    def _streamed(self, path: str, body: dict, kind: type[M]) -> RequestStream[M]:
        return TokenStream(lambda token: self._stream(path, body, kind, token))

    def _stream(self, path: str, body: dict, kind: type[M], token: CancelToken) -> Generator[M, None, None]:
        """POST and yield one `kind` per NDJSON line; an {"error": ...} line raises. Closing the generator early,
        or cancelling the token, closes the response (the server cancels the request); the stream then ends."""
        if token.cancelled:
            return
        with self._reaching_server(), self._http.stream("POST", path, json=body) as response:
            token.on_cancel(response.close)
            if response.status_code >= 400:
                response.read()
                raise error_for(response)
            try:
                for line in response.iter_lines():
                    if line.strip():
                        yield _parse_line(line, kind)
            except (httpx.HTTPError, httpx.StreamError):
                if not token.cancelled:  # a read cut short by our own cancel is the end, not an error
                    raise

    # ----------------------------------------------------------------------------------------------- models

    def version(self) -> str:
        answer = self._get("/api/version", api.VersionResponse)
        return answer.localllm or answer.version

    def list_models(self) -> api.ListResponse:
        return self._get("/api/tags", api.ListResponse)

    def show(self, model: str, *, verbose: bool = False) -> api.ShowResponse:
        return self._post("/api/show", {"model": model, "verbose": verbose}, api.ShowResponse)

    def has_blob(self, digest: str) -> bool:
        with self._reaching_server():
            response = self._http.head(f"/api/blobs/{digest}")
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            raise error_for(response)
        return True

    def add_blob(self, digest: str, source: BinaryIO) -> None:
        with self._reaching_server():
            response = self._http.post(f"/api/blobs/{digest}", content=iter(lambda: source.read(1 << 20), b""))
        if response.status_code >= 400:
            raise error_for(response)

    def pull(self, model: str) -> RequestStream[api.PullProgress]:
        return self._streamed("/api/pull", {"model": model, "stream": True}, api.PullProgress)

    def create(self, request: api.CreateRequest) -> RequestStream[api.PullProgress]:
        return self._streamed("/api/create", _body(request), api.PullProgress)

    def copy(self, source: str, destination: str) -> None:
        self._call("POST", "/api/copy", {"source": source, "destination": destination})

    def delete(self, model: str) -> None:
        self._call("DELETE", "/api/delete", {"model": model})

    def ps(self) -> api.ProcessResponse:
        return self._get("/api/ps", api.ProcessResponse)

    def plan(self, request: api.PlanRequest) -> api.PlanResponse:
        return self._post("/api/plan", request.model_dump(exclude_none=True), api.PlanResponse)

    def stop(self, model: str) -> None:
        # Ollama's way to unload: nothing to generate and keep_alive 0.
        self._call("POST", "/api/generate", {"model": model, "keep_alive": 0, "stream": False})

    # ----------------------------------------------------------------------------------------------- inference

    def generate(self, request: api.GenerateRequest) -> RequestStream[api.GenerateChunk]:
        return self._streamed("/api/generate", _body(request), api.GenerateChunk)

    def chat(self, request: api.ChatRequest) -> RequestStream[api.ChatChunk]:
        return self._streamed("/api/chat", _body(request), api.ChatChunk)

    def embed(self, request: api.EmbedRequest, cancelled: Callable[[], bool] = lambda: False) -> api.EmbedResponse:
        # The server stops the work when this connection closes; nothing here polls `cancelled` midway.
        return self._post("/api/embed", _body(request), api.EmbedResponse)

    def rerank(self, request: api.RerankRequest) -> api.RerankResponse:
        # llama-server's path, whose errors are Ollama's plain strings (under /v1 they are OpenAI's objects).
        return self._post("/rerank", _body(request), api.RerankResponse)

    def generate_batch(self, requests: list[api.GenerateRequest]) -> RequestStream[tuple[int, api.GenerateChunk]]:
        bodies = [_body(request) for request in requests]
        return TokenStream(lambda token: self._one_by_one("/api/generate", bodies, api.GenerateChunk, token))

    def chat_batch(self, requests: list[api.ChatRequest]) -> RequestStream[tuple[int, api.ChatChunk]]:
        bodies = [_body(request) for request in requests]
        return TokenStream(lambda token: self._one_by_one("/api/chat", bodies, api.ChatChunk, token))

    def _one_by_one(
        self, path: str, bodies: list[dict], kind: type[M], token: CancelToken
    ) -> Generator[tuple[int, M], None, None]:
        # Ollama's API has no batch: the requests run one after the other, each chunk tagged with its index.
        for index, body in enumerate(bodies):
            chunks = self._stream(path, body, kind, token)
            try:
                yield from ((index, chunk) for chunk in chunks)
            finally:
                chunks.close()

    def save_prompt_cache(self, request: api.ChatRequest) -> bytes:
        body = request.model_dump(mode="json", exclude_none=True, by_alias=True)
        return self._call("POST", "/api/prompt-cache/save", body).content

    def load_prompt_cache(self, request: api.ChatRequest, data: bytes) -> int:
        which = request.model_copy(update={"messages": []}).model_dump_json(exclude_none=True, by_alias=True)
        with self._reaching_server():
            response = self._http.post(
                "/api/prompt-cache/load",
                params={"request": which},
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
        if response.status_code >= 400:
            raise error_for(response)
        return int(response.json()["tokens"])

    def count_tokens(self, request: api.ChatRequest) -> int:
        body = request.model_dump(mode="json", exclude_none=True, by_alias=True)
        return int(self._call("POST", "/api/count_tokens", body).json()["input_tokens"])


def _body(request: BaseModel) -> dict:
    body = request.model_dump(mode="json", exclude_none=True, by_alias=True)
    if "stream" in type(request).model_fields:
        body["stream"] = True  # the Client API always yields chunks
    return body


def _parse_line(line: str, kind: type[M]) -> M:
    try:
        data = json.loads(line)
    except ValueError:
        raise LocalLLMError(f"the server sent a line that is not JSON: {line[:200]!r}") from None
    if isinstance(data, dict) and "error" in data:
        raise LocalLLMError(str(data["error"]))
    return kind.model_validate(data)
