"""The REST server: `create_app(client)` builds the FastAPI app that serves Ollama's API and OpenAI's on one port.

Handlers only go through the Client interface (client/protocol.py); nothing here imports an engine or a backend.
Middleware, outermost first: the access log and request metrics, CORS for configured origins only, the guard (Host,
key, body size)."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__, config
from ..client.protocol import Client
from . import infill_routes, mcp_routes, ollama_routes, prompt_cache_routes, rerank_routes, web_routes
from .anthropic import routes as anthropic_routes
from .metrics import CONTENT_TYPE, AccessLog, ServerMetrics
from .openai import responses_routes as openai_responses
from .openai import routes as openai_routes
from .responses import install_error_handlers
from .security import GuardMiddleware, GuardSettings, is_loopback_host
from .state import ServerState, State

service = APIRouter()


@service.get("/health")
async def health(state: State) -> JSONResponse:
    # `home` and `pid` let `localllm run` and `serve --status` tell which server this is (see cli/background.py);
    # `network` lets the web page say that other machines can reach it.
    return JSONResponse(
        {
            "status": "ok",
            "version": __version__,
            "home": config.home_id(),
            "pid": os.getpid(),
            "network": state.network,
        }
    )


@service.get("/metrics")
def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


class AssumeJson:
    """Ollama reads every body as JSON whatever its Content-Type (`curl -d` sends a form type); FastAPI would
    ignore such a body, so it is relabelled before routing."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "DELETE"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            # In place: the access log reads the matched route from this same scope afterwards.
            scope["headers"] = headers + [(b"content-type", b"application/json")]
        await self.app(scope, receive, send)


def _default_client() -> Client:
    from ..client.local import LocalClient

    return LocalClient()


def create_app(client: Client | None = None, *, bound_host: str | None = None, mcp: bool | None = None) -> FastAPI:
    """The app serving `client` (default: a LocalClient on LOCALLLM_HOME, closed on shutdown).

    Args:
        client: what the routes call; any Client implementation.
        bound_host: the host the server listens on, accepted in Host headers (default: LOCALLLM_HOST's host).
        mcp: serve the web page's MCP tool routes (default: LOCALLLM_MCP; `serve --mcp`).
    """
    owned = client is None
    served = client if client is not None else _default_client()
    toolbox = mcp_routes.open_server_toolbox(config.MCP.get() if mcp is None else mcp)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if toolbox is not None:
            toolbox.close()
        if owned:
            served.close()

    app = FastAPI(title="localllm", version=__version__, lifespan=lifespan)
    host = bound_host if bound_host is not None else config.HOST.get()[0]
    state = ServerState(client=served, metrics=ServerMetrics(served), network=not is_loopback_host(host))
    app.state.localllm = state
    app.state.mcp = toolbox
    install_error_handlers(app)
    app.include_router(web_routes.router)  # `/`: the page for a browser, plain text for the rest
    app.include_router(service)
    app.include_router(ollama_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(prompt_cache_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(openai_responses.router)
    app.include_router(infill_routes.router)
    app.include_router(rerank_routes.router)
    app.include_router(mcp_routes.router)
    # add_middleware wraps, so the last added runs first: access log, CORS, guard, then the JSON relabelling.
    app.add_middleware(AssumeJson)
    app.add_middleware(GuardMiddleware, settings=GuardSettings.from_config(bound_host))
    origins = config.ORIGINS.get()
    if origins:  # outside the guard, so an allowed page can read the guard's errors too
        globs = [o for o in origins if "*" in o and o != "*"]  # chrome-extension://* and the like, as Ollama takes
        app.add_middleware(
            CORSMiddleware,
            allow_origins=[o for o in origins if o not in globs],
            allow_methods=["*"],
            allow_origin_regex="|".join(fnmatch.translate(g) for g in globs) or None,
            allow_headers=["*"],
        )
    app.add_middleware(AccessLog, metrics=state.metrics)
    return app
