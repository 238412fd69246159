"""The server's guard: Host check (DNS rebinding), Origin check (cross-site requests), bearer key, body type and
body size limit, as one pure ASGI middleware.

Pure ASGI rather than BaseHTTPMiddleware so streaming responses and client disconnects pass through untouched.

DNS rebinding works by pointing an attacker's *name* at 127.0.0.1, so the browser sends that name as Host. A Host
that is an IP literal, `localhost`, the bound host, this machine's name or a configured name is safe; any other name
gets 403 (Ollama does the same).

Any web page can send a POST to 127.0.0.1 ("simple" requests skip the CORS preflight), and the browser says which
page sent it in `Origin`. A request whose Origin is not a loopback page, an IDE webview or in LOCALLLM_ORIGINS gets
403 before any route runs, as Ollama answers. Clients that are not browsers send no Origin. As a second line, a body
on a JSON route must be JSON: a `text/plain` or multipart body (what an HTML form can send without a preflight) is a
415. The form type `curl -d` sends by default is still read as JSON: a browser form percent-encodes it, so it can
never carry a JSON body, and a script's fetch always carries an Origin."""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import config
from ..errors import Forbidden, LocalLLMError, PayloadTooLarge, Unauthorized, UnsupportedMediaType
from .responses import error_response

# Routes a load balancer or a "is it up?" probe may call without the key.
OPEN_PATHS = frozenset({"/", "/health"})
# The web page's own files (server/web_routes.py): the page loads without the key, then asks for it; every API call
# it makes needs the key as any client's does.
OPEN_PREFIX = "/ui/"
# Uploads of model files (Ollama's POST /api/blobs/:digest) are weights, gigabytes: the JSON body limit does not
# apply; the bytes go to disk and must hash to the digest in the path.
UNLIMITED_BODY_PREFIX = "/api/blobs/"
# Pages that may call the server from a browser without configuration: IDE webviews and desktop app shells (Ollama
# allows the same schemes), besides http(s) pages served from loopback.
APP_SCHEMES = frozenset({"app", "tauri", "vscode-webview", "vscode-file"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Every other route that takes a body reads JSON. `curl -d` labels it as a form (see the module docstring).
JSON_TYPES = frozenset({"application/json", "application/x-www-form-urlencoded"})
# Routes whose body is bytes, not JSON: model files (Ollama's blob uploads) and prompt-cache files.
BINARY_BODY_ROUTES = (UNLIMITED_BODY_PREFIX, "/api/prompt-cache/load")


@dataclass(frozen=True)
class GuardSettings:
    allowed_hosts: frozenset[str]
    api_key: str = ""
    max_body: int = 32 * 1024 * 1024
    any_host: bool = False
    origins: tuple[str, ...] = ()  # LOCALLLM_ORIGINS: exact origins or globs such as chrome-extension://*

    @classmethod
    def from_config(cls, bound_host: str | None = None) -> GuardSettings:
        host = bound_host if bound_host is not None else config.HOST.get()[0]
        extra = {h.lower() for h in config.ALLOWED_HOSTS.get()}
        names = {"localhost", host.lower(), socket.gethostname().lower()} | extra
        return cls(
            allowed_hosts=frozenset(names),
            api_key=config.API_KEY.get(),
            max_body=config.MAX_BODY.get(),
            any_host="*" in extra,
            origins=tuple(o.lower() for o in config.ORIGINS.get()),
        )


def host_name(header: str) -> str:
    """The name in a Host header without its port: "[::1]:80" → "::1", "example.com:80" → "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str | None, settings: GuardSettings) -> bool:
    if not header or settings.any_host:
        return True
    name = host_name(header)
    try:
        ipaddress.ip_address(name)
        return True  # an address literal cannot be rebound
    except ValueError:
        pass
    return name in settings.allowed_hosts or name.endswith(".localhost")


def origin_allowed(origin: str | None, settings: GuardSettings) -> bool:
    """No Origin (not a browser), a loopback page, an IDE webview, or one LOCALLLM_ORIGINS names."""
    if origin is None:
        return True
    origin = origin.strip().lower()
    if any(fnmatch.fnmatchcase(origin, pattern) for pattern in settings.origins):
        return True
    try:
        parts = urlsplit(origin)
        host = parts.hostname or ""
    except ValueError:
        return False
    if parts.scheme in APP_SCHEMES:
        return True
    if parts.scheme not in ("http", "https"):
        return False  # "null" (sandboxed frames, file pages), extensions, anything unknown
    return is_loopback_host(host)


def is_loopback_host(host: str) -> bool:
    """A page's host or a listening address only this machine reaches: localhost or a loopback IP (a name or
    0.0.0.0 is not)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def body_type_allowed(content_type: str | None) -> bool:
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


def key_matches(authorization: str | None, api_key: str, x_api_key: str | None = None) -> bool:
    """`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` (what Claude Code and the anthropic package
    send)."""
    if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), api_key.encode()):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


@dataclass
class GuardMiddleware:
    app: ASGIApp
    settings: GuardSettings = field(default_factory=GuardSettings.from_config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check(scope)
        except LocalLLMError as exc:
            await error_response(exc, scope["path"])(scope, receive, send)
            return
        unlimited = scope["path"].startswith(UNLIMITED_BODY_PREFIX)
        await self.app(scope, receive if unlimited else self._limited(receive), send)

    def _check(self, scope: Scope) -> None:
        headers = Headers(scope=scope)
        if not host_allowed(headers.get("host"), self.settings):
            raise Forbidden(
                f"Host {headers.get('host')!r} is not allowed",
                hint="call the server by 127.0.0.1 or localhost, or add the name to LOCALLLM_ALLOWED_HOSTS",
            )
        if not origin_allowed(headers.get("origin"), self.settings):
            raise Forbidden(
                f"requests from the web page {headers.get('origin')!r} are not allowed",
                hint="add the page's origin to LOCALLLM_ORIGINS to let it call this server",
            )
        if self._needs_key(scope) and not key_matches(
            headers.get("authorization"), self.settings.api_key, headers.get("x-api-key")
        ):
            raise Unauthorized(
                "missing or wrong API key",
                hint="send `Authorization: Bearer <key>` or `x-api-key: <key>` with LOCALLLM_API_KEY",
            )
        if (
            scope["method"] in BODY_METHODS
            and not scope["path"].startswith(BINARY_BODY_ROUTES)
            and not body_type_allowed(headers.get("content-type"))
        ):
            raise UnsupportedMediaType(
                f"the request body is {headers.get('content-type')!r}; this route reads JSON",
                hint="send it with `Content-Type: application/json`",
            )
        length = headers.get("content-length")
        if scope["path"].startswith(UNLIMITED_BODY_PREFIX):
            return
        if length and length.isdigit() and int(length) > self.settings.max_body:
            raise self._too_large(length)

    def _needs_key(self, scope: Scope) -> bool:
        if not self.settings.api_key or scope["method"] == "OPTIONS":  # CORS preflights never carry credentials
            return False
        is_open = scope["path"] in OPEN_PATHS or scope["path"].startswith(OPEN_PREFIX)
        return not (is_open and scope["method"] in ("GET", "HEAD"))

    def _too_large(self, size: str) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body ({size} bytes) is over the limit of {self.settings.max_body} bytes",
            hint="raise LOCALLLM_MAX_BODY",
        )

    def _limited(self, receive: Receive) -> Receive:
        """Count body bytes as they arrive: a chunked upload has no Content-Length to check up front."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.settings.max_body:
                    # FastAPI turns other exceptions raised while reading the body into a 400; HTTPException passes.
                    raise HTTPException(413, detail=str(self._too_large(f"at least {seen}")))
            return message

        return counted
