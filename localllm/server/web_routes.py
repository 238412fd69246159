"""The browser page: `GET /` answers a browser with the web UI (localllm/web/) and anything else with the plain text
probes and Ollama-style clients read; the page's files are under /ui/. The page calls the public API only.

Every file goes out with a strict Content-Security-Policy (scripts and styles from this server only, no inline
script, no eval, no request to any other host) and nosniff, so model text that slipped past the sanitiser still
could not run. The files are read once and kept in memory, gzipped for clients that take it; an ETag lets a reload
revalidate instead of downloading again.

One public route here is a localllm extension the page needs and the API lacked: GET /api/catalog lists the built-in
catalog (what `localllm ls --catalog` shows) so the models page can offer it beside the store."""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..models.catalog import CATALOG

router = APIRouter()

WEB = Path(__file__).resolve().parent.parent / "web"
UI_PREFIX = "/ui/"
RUNNING = "localllm is running"
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",  # attached images are previewed from the browser's own memory
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
GZIP_FROM = 1024  # smaller files gain nothing from compression


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes | None
    media_type: str
    etag: str


@cache
def load_asset(relative: str) -> Asset | None:
    """The file at `relative` under localllm/web/, or None for anything else (other folders, other file types)."""
    parts = PurePosixPath(relative).parts
    if not parts or any(part in ("..", ".") or part.startswith(".") for part in parts):
        return None
    path = WEB.joinpath(*parts)
    media_type = TYPES.get(path.suffix)
    if media_type is None or not path.is_file():
        return None
    body = path.read_bytes()
    packed = gzip.compress(body, mtime=0) if len(body) >= GZIP_FROM else None
    return Asset(body, packed, media_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')


def asset_response(asset: Asset, request: Request) -> Response:
    headers = {**SECURITY_HEADERS, "ETag": asset.etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding"}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    if asset.gzipped is not None and "gzip" in request.headers.get("accept-encoding", ""):
        return Response(asset.gzipped, media_type=asset.media_type, headers={**headers, "Content-Encoding": "gzip"})
    return Response(asset.body, media_type=asset.media_type, headers=headers)


def prefers_html(accept: str) -> bool:
    """A browser's navigation asks for text/html ahead of everything else; curl, httpx and Ollama's clients send
    `*/*` or nothing, and get the plain text."""
    html, other = 0.0, 0.0
    for item in accept.split(","):
        media, _, params = item.strip().partition(";")
        quality = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        media = media.strip().lower()
        if media in ("text/html", "application/xhtml+xml"):
            html = max(html, quality)
        elif media and "*" not in media:
            other = max(other, quality)
    return html > 0 and html >= other


@router.get("/")
@router.head("/")
async def front_page(request: Request) -> Response:
    if not prefers_html(request.headers.get("accept", "")):
        return PlainTextResponse(RUNNING)
    page = load_asset("index.html")
    if page is None:  # a package built without its web files still answers the probes
        return PlainTextResponse(RUNNING)
    return asset_response(page, request)


@router.get(UI_PREFIX + "{relative:path}")
async def ui_file(relative: str, request: Request) -> Response:
    asset = load_asset(relative)
    if asset is None:
        return JSONResponse({"error": f"no file {relative!r} in the web UI"}, status_code=404)
    return asset_response(asset, request)


@router.get("/api/catalog")
def catalog() -> JSONResponse:
    """The built-in catalog (a localllm extension): name, description, size in bytes, capabilities."""
    rows = [
        {"name": e.name, "description": e.description, "size": e.size, "capabilities": e.capabilities} for e in CATALOG
    ]
    return JSONResponse({"models": rows})
