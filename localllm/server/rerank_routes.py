"""Reranking, in the shape llama-server, Jina and Cohere share: POST /v1/rerank (and /rerank, llama-server's own
path) with a query and documents; the answer lists each document's index and relevance_score, best first, cut to
top_n, with `document.text` when return_documents asks for it. The model must be a reranker (rank pooling)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from .. import api
from .offloop import json_body
from .state import State

router = APIRouter()


@router.post("/v1/rerank")
@router.post("/rerank")
def rerank(body: Annotated[api.RerankRequest, json_body(api.RerankRequest)], state: State) -> JSONResponse:
    body.options = api.request_options(body.options)
    response = state.client.rerank(body)
    return JSONResponse(response.model_dump(mode="json", exclude_none=True))
