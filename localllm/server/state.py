"""What every route needs from the app: the client it serves and the metrics it feeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from ..client.protocol import Client
from .metrics import ServerMetrics


@dataclass
class ServerState:
    client: Client
    metrics: ServerMetrics
    network: bool = False  # bound beyond loopback: other machines may reach it (/health says so to the page)


async def get_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain function dependency on a worker thread, a hop every request would wait for
    return request.app.state.localllm


State = Annotated[ServerState, Depends(get_state)]
