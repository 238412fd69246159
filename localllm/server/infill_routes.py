"""llama-server's /infill, what llama.vscode and llama.vim send for editor completion: the code before and after the
cursor (input_prefix, input_suffix), the cursor line's start (prompt), other files (input_extra), and /completion's
sampling fields. The answer is llama-server's completion object, or with `stream` its server-sent events (no
`[DONE]`, as llama-server ends this stream); `response_fields` picks fields as llama-server does.

llama-server serves one model; a request that names none gets LOCALLLM_INFILL_MODEL."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .. import api, config
from .chunk_stream import ChunkStream
from .offloop import json_body
from .responses import StreamResponse, client_gone, error_payload, merge_generate
from .state import State

router = APIRouter()


class InfillRequest(BaseModel):
    """The fields of llama-server's /infill that mean something here; the rest of its options are accepted and
    ignored, as llama-server ignores what it does not know."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    input_prefix: str
    input_suffix: str
    input_extra: list[api.InfillFile] = Field(default_factory=list, max_length=1024)
    prompt: str = ""
    stream: bool = False
    n_predict: int = Field(-1, ge=-1, le=api.INT32_MAX)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=api.INT32_MAX)
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, le=2**32 - 1)
    stop: list[str] | None = Field(None, max_length=64)
    repeat_penalty: float | None = Field(None, ge=0, allow_inf_nan=False)
    repeat_last_n: int | None = Field(None, ge=-1, le=api.INT32_MAX)
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    ignore_eos: bool = False
    response_fields: list[str] | None = Field(None, max_length=64)
    keep_alive: api.Duration | None = None  # parsed here as every request's is, so a bad one is a 400

    def generate_request(self) -> api.GenerateRequest:
        options = {
            "num_predict": self.n_predict,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed if self.seed != -1 else None,  # llama-server's -1: a random seed
            "stop": self.stop,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.repeat_last_n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos or None,
        }
        return api.GenerateRequest(
            model=self.model or config.INFILL_MODEL.get(),
            prompt=self.input_prefix,
            suffix=self.input_suffix,
            middle=self.prompt,
            input_extra=self.input_extra,
            stream=self.stream,
            options=api.request_options(options),
            keep_alive=self.keep_alive,
        )


@router.post("/infill")
async def infill(body: Annotated[InfillRequest, json_body(InfillRequest)], state: State, http: Request) -> Response:
    request = body.generate_request()
    chunks = await ChunkStream.open(
        lambda: state.client.generate(request), observe=state.metrics.observe_chunk, disconnected=http.is_disconnected
    )
    if body.stream:
        return StreamResponse(_events(chunks, request.model), chunks, media_type="text/event-stream")
    collected = await chunks.collect(disconnected=http.is_disconnected)
    if not collected:
        return client_gone()
    return JSONResponse(pick_fields(completion(merge_generate(collected), request.model), body.response_fields))


def completion(chunk: api.GenerateChunk, model: str) -> dict[str, Any]:
    """llama-server's completion object: the whole answer, or (not done) one streamed piece."""
    out: dict[str, Any] = {
        "index": 0,
        "content": chunk.response,
        "tokens": chunk.tokens or [],
        "stop": chunk.done,
        "id_slot": -1,
        "tokens_predicted": chunk.eval_count,
        "tokens_evaluated": chunk.prompt_eval_count,
    }
    if chunk.done:
        out.update(
            model=model,
            truncated=chunk.truncated_tokens > 0,
            stop_type=_stop_type(chunk),
            stopping_word=chunk.stop_sequence or "",
            tokens_cached=chunk.prompt_cache_count,
            has_new_line="\n" in chunk.response,
            timings=timings(chunk),
        )
    return out


def _stop_type(chunk: api.GenerateChunk) -> str:
    if chunk.done_reason == "length":
        return "limit"
    return "word" if chunk.stop_sequence else "eos"


def timings(chunk: api.Timings) -> dict[str, Any]:
    """llama-server's timings: cache_n prompt tokens reused, prompt_n evaluated, and the generation's."""
    prompt_ms = chunk.prompt_eval_duration / 1e6
    predicted_ms = chunk.eval_duration / 1e6
    prompt_n = chunk.prompt_eval_count - chunk.prompt_cache_count
    return {
        "cache_n": chunk.prompt_cache_count,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms else 0.0,
        "predicted_n": chunk.eval_count,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / chunk.eval_count if chunk.eval_count else 0.0,
        "predicted_per_second": chunk.eval_count * 1e3 / predicted_ms if predicted_ms else 0.0,
    }


def pick_fields(body: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama-server's response_fields: only these, a path `a/b` read from inside `a` and kept under its path."""
    if not fields:
        return body
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


async def _events(stream: ChunkStream, model: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield b"data: " + json.dumps(completion(chunk, model), separators=(",", ":")).encode() + b"\n\n"
    except Exception as exc:  # noqa: BLE001 - the status line is gone; the error travels as an event
        yield b"data: " + json.dumps(error_payload(exc)).encode() + b"\n\n"
