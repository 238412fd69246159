"""The whole error hierarchy. Each surface maps it in one place: exit codes in the CLI, status codes in REST,
notifications in the TUI. Messages are one line and say which value, why, and what to do."""

from __future__ import annotations


class LocalLLMError(Exception):
    """Base of every error a user can cause or fix."""

    status_code = 500

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InvalidInput(LocalLLMError):
    """A request, option or argument that cannot be used as given."""

    status_code = 400


class InvalidName(InvalidInput):
    """A model name or digest that does not follow the grammar in names.py."""


class ConfigError(InvalidInput):
    """A LOCALLLM_* variable with a bad value; the message names the variable."""


class ModelfileError(InvalidInput):
    """A Modelfile that does not parse; carries the line number."""

    def __init__(self, line: int, message: str):
        super().__init__(f"Modelfile line {line}: {message}")
        self.line = line


class ModelNotFound(LocalLLMError):
    status_code = 404


class ResponseNotFound(LocalLLMError):
    """A stored /v1/responses answer that does not exist (never stored, deleted, or pruned)."""

    status_code = 404


class ModelFormatError(LocalLLMError):
    """A weights file that is truncated, malformed or of a kind we cannot run."""

    status_code = 400


class IntegrityError(LocalLLMError):
    """Downloaded or stored bytes whose sha256 is not the one expected."""

    status_code = 502


class NetworkError(LocalLLMError):
    """A source could not be reached, or offline mode forbids reaching it."""

    status_code = 502


class NotStoredOffline(NetworkError):
    """A name the store lacks while offline mode forbids pulling it: absent here (404), no network fault."""

    status_code = 404


class DiskFull(LocalLLMError):
    """Not enough free space for a download or a write; the message says what, how much and where."""

    status_code = 507


class BackendUnavailable(LocalLLMError):
    """An optional backend whose package is not installed; the hint says what to install."""

    status_code = 501


class ContextOverflow(InvalidInput):
    """A prompt that does not fit in a slot's context."""

    def __init__(self, *, prompt_tokens: int, num_ctx: int, reserved: int = 0):
        super().__init__(
            f"prompt is {prompt_tokens} tokens but the context holds {num_ctx} per slot"
            + (f" ({reserved} kept free for the answer)" if reserved else ""),
            hint="shorten the prompt, raise num_ctx, or pass truncate",
        )
        self.prompt_tokens = prompt_tokens
        self.num_ctx = num_ctx


class PayloadTooLarge(InvalidInput):
    status_code = 413


class QueueFull(LocalLLMError):
    """The engine's bounded queue is full; retry later (HTTP 503 with Retry-After)."""

    status_code = 503
    retry_after = 1


class Cancelled(LocalLLMError):
    """The request was cancelled (client gone, or the model was unloaded)."""

    status_code = 499


class Unauthorized(LocalLLMError):
    status_code = 401


class Forbidden(LocalLLMError):
    status_code = 403


class UnsupportedMediaType(InvalidInput):
    """A request body in a type the route does not read (JSON routes take JSON)."""

    status_code = 415


class ServerUnreachable(LocalLLMError):
    """The HTTP client found no localllm server at the configured address."""

    status_code = 503


class ServerConflict(LocalLLMError):
    """The server at the configured address serves another LOCALLLM_HOME (its models, not ours)."""

    status_code = 409


class WorkerLost(LocalLLMError):
    """An RPC worker (`localllm worker`) cannot be reached, does not answer, or went away while a model used it:
    503 while it is gone (the next request after it is back loads the model with it again)."""

    status_code = 503
    retry_after = 5
