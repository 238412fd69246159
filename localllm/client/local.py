"""The in-process Client: the model store plus the model pool. The REST server serves this; `localllm run` uses it
when no server is running and the CLI is asked to run in-process.

A chat request becomes a prompt here (Modelfile messages and system, then the request's messages, rendered with the
model's chat template), then tokens, then an engine submission; engine chunks become api chunks."""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Iterator, Optional

from .. import __version__, api, config
from ..models.create import create_model
from ..engine.pool import Loaded, ModelPool, resolve_options
from ..engine.runner import EngineChunk, GenerationParams
from ..errors import InvalidInput
from ..models.info import show_model
from ..models.plan import Placement
from ..models.pull import pull_model
from ..engine.speculative.speculation import load_speculation
from ..models.store import ResolvedModel, Store
from ..structured import grammar_for_format, parse_tool_calls, tool_choice_grammar
from ..templates import render_chat


def _keep_alive(value: Any) -> Optional[float]:
    if value is None:
        return None
    try:
        return config.parse_duration(value)
    except ValueError as exc:
        raise InvalidInput(f"keep_alive {value!r} is not valid: {exc}") from None


def _timing_fields(chunk: EngineChunk, loaded: Loaded, first_request: bool) -> dict[str, Any]:
    timings = chunk.timings.model_dump() if chunk.timings else {}
    load_ns = int(loaded.load_seconds * 1e9) if first_request else 0
    timings["load_duration"] = load_ns
    timings["total_duration"] = timings.get("total_duration", 0) + load_ns
    return timings


class LocalClient:
    def __init__(self, store: Optional[Store] = None, pool: Optional[ModelPool] = None):
        self.store = store or Store()
        self.pool = pool or ModelPool(self.store, speculation_factory=partial(load_speculation, self.store))

    # ----------------------------------------------------------------------------------------------- models

    def version(self) -> str:
        return __version__

    def list_models(self) -> api.ListResponse:
        return api.ListResponse(models=self.store.list())

    def show(self, model: str) -> api.ShowResponse:
        return show_model(self.store, model)

    def pull(self, model: str) -> Iterator[api.PullProgress]:
        return pull_model(model, self.store)

    def create(self, request: api.CreateRequest) -> Iterator[api.PullProgress]:
        return create_model(request, self.store)

    def copy(self, source: str, destination: str) -> None:
        self.store.copy(source, destination)

    def delete(self, model: str) -> None:
        resolved = self.store.resolve(model)
        self.pool.unload(resolved.digest)
        self.store.delete(model)

    def ps(self) -> api.ProcessResponse:
        return api.ProcessResponse(models=[_process_row(e) for e in self.pool.entries()])

    def stop(self, model: str) -> None:
        resolved = self.store.resolve(model)
        self.pool.unload(resolved.digest)

    def close(self) -> None:
        self.pool.close()

    # ----------------------------------------------------------------------------------------------- inference

    def generate(self, request: api.GenerateRequest) -> Iterator[api.GenerateChunk]:
        _refuse_images(request.images)
        model = self.store.resolve(request.model)
        load, sampling = resolve_options(model, request.options)
        keep_alive = _keep_alive(request.keep_alive)
        if not request.prompt and not request.context:
            # Ollama: an empty prompt loads the model (or unloads it with keep_alive 0) and answers done.
            yield from self._load_only(model, load, keep_alive, request.model)
            return
        grammar = grammar_for_format(request.format)
        with self.pool.acquire(model, load, keep_alive=keep_alive) as loaded:
            tokens = self._generate_tokens(loaded, model, request)
            stream = loaded.engine.submit(GenerationParams(tokens, sampling, grammar, request.truncate,
                                                           _logprobs_wanted(request)))
            first = loaded.engine.stats.requests == 0
            generated: list[int] = []
            for chunk in stream:
                generated.extend(chunk.tokens)
                # Ollama's `context`: the conversation so far as tokens, to send back with the next prompt. Ours is
                # the prompt's tokens as sent to the engine and the answer's, so the next request finds them in the
                # prefix cache (all but the answer's last token, which was never decoded).
                context = tokens + generated if chunk.done and not request.raw else None
                yield self._generate_chunk(request.model, chunk, loaded, first, context)

    def _generate_tokens(self, loaded: Loaded, model: ResolvedModel, request: api.GenerateRequest) -> list[int]:
        if request.raw:
            text = request.prompt
        else:
            messages = _messages_with_system(model, request.system, [api.Message(role="user", content=request.prompt)])
            text = self._render(loaded, model, messages, template=request.template)
        tokens = list(request.context or []) + (self._tokenize(loaded, text) if text else [])
        return tokens

    @staticmethod
    def _generate_chunk(name: str, chunk: EngineChunk, loaded: Loaded, first: bool,
                        context: Optional[list[int]]) -> api.GenerateChunk:
        if not chunk.done:
            return api.GenerateChunk(model=name, response=chunk.text, tokens=list(chunk.tokens),
                                     logprobs=_logprobs(loaded, chunk))
        return api.GenerateChunk(model=name, response=chunk.text, done=True, done_reason=chunk.done_reason,
                                 context=context, **_timing_fields(chunk, loaded, first))

    def chat(self, request: api.ChatRequest) -> Iterator[api.ChatChunk]:
        for message in request.messages:
            _refuse_images(message.images)
        model = self.store.resolve(request.model)
        load, sampling = resolve_options(model, request.options)
        keep_alive = _keep_alive(request.keep_alive)
        if not request.messages:
            yield from (api.ChatChunk(model=c.model, done=True, done_reason=c.done_reason)
                        for c in self._load_only(model, load, keep_alive, request.model))
            return
        grammar = grammar_for_format(request.format) or tool_choice_grammar(request.tools, request.tool_choice)
        tools = request.tools if request.tool_choice != "none" else None
        with self.pool.acquire(model, load, keep_alive=keep_alive) as loaded:
            messages = _messages_with_system(model, None, request.messages)
            text = self._render(loaded, model, messages, tools=[t.model_dump() for t in tools] if tools else None)
            tokens = self._tokenize(loaded, text)
            stream = loaded.engine.submit(GenerationParams(tokens, sampling, grammar, request.truncate,
                                                           _logprobs_wanted(request)))
            first = loaded.engine.stats.requests == 0
            if tools:
                yield from self._chat_with_tools(request.model, stream, loaded, first, tools)
            else:
                for chunk in stream:
                    yield self._chat_chunk(request.model, chunk, loaded, first)

    def _chat_with_tools(self, name: str, stream, loaded: Loaded, first: bool, tools) -> Iterator[api.ChatChunk]:
        # Tool calls can only be recognised once the whole answer is known, so the text is held until the end.
        parts: list[str] = []
        for chunk in stream:
            parts.append(chunk.text)
            if chunk.done:
                content, calls = parse_tool_calls("".join(parts), tools)
                message = api.Message(role="assistant", content=content, tool_calls=calls or None)
                yield api.ChatChunk(model=name, message=message, done=True, done_reason=chunk.done_reason,
                                    **_timing_fields(chunk, loaded, first))

    @staticmethod
    def _chat_chunk(name: str, chunk: EngineChunk, loaded: Loaded, first: bool) -> api.ChatChunk:
        message = api.Message(role="assistant", content=chunk.text)
        if not chunk.done:
            return api.ChatChunk(model=name, message=message, tokens=list(chunk.tokens),
                                 logprobs=_logprobs(loaded, chunk))
        return api.ChatChunk(model=name, message=message, done=True, done_reason=chunk.done_reason,
                             **_timing_fields(chunk, loaded, first))

    def embed(self, request: api.EmbedRequest) -> api.EmbedResponse:
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        inputs = [request.input] if isinstance(request.input, str) else list(request.input)
        t0 = time.perf_counter()
        with self.pool.acquire(model, load, keep_alive=_keep_alive(request.keep_alive)) as loaded:
            tokenized = [self._embed_tokens(loaded, text, request.truncate) for text in inputs]
            vectors = loaded.engine.embed(tokenized)
        return api.EmbedResponse(model=request.model, embeddings=vectors,
                                 total_duration=int((time.perf_counter() - t0) * 1e9),
                                 prompt_eval_count=sum(map(len, tokenized)))

    def _embed_tokens(self, loaded: Loaded, text: str, truncate: bool) -> list[int]:
        tokens = self._tokenize(loaded, text)
        limit = loaded.engine.n_ctx
        if len(tokens) > limit:
            if not truncate:
                from ..errors import ContextOverflow

                raise ContextOverflow(prompt_tokens=len(tokens), num_ctx=limit)
            tokens = tokens[:limit]
        return tokens

    # ----------------------------------------------------------------------------------------------- helpers

    def _load_only(self, model: ResolvedModel, load: api.LoadOptions, keep_alive: Optional[float],
                   name: str) -> Iterator[api.GenerateChunk]:
        with self.pool.acquire(model, load, keep_alive=keep_alive):
            pass
        reason = "unload" if keep_alive is not None and keep_alive <= 0 else "load"
        yield api.GenerateChunk(model=name, done=True, done_reason=reason)

    @staticmethod
    def _render(loaded: Loaded, model: ResolvedModel, messages: list[api.Message], *,
                template: Optional[str] = None, tools: Optional[list] = None) -> str:
        meta = loaded.engine.model.meta
        source = template or model.template or meta.chat_template
        return render_chat(source, [m.model_dump(exclude_none=True) for m in messages], tools=tools,
                           bos_token=_token_text(loaded, meta.bos_token), eos_token=_token_text(loaded, meta.eos_token))

    @staticmethod
    def _tokenize(loaded: Loaded, text: str) -> list[int]:
        meta = loaded.engine.model.meta
        bos = _token_text(loaded, meta.bos_token)
        # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
        add_special = not (bos and text.startswith(bos))
        return loaded.engine.tokenize(text, add_special=add_special, parse_special=True)


def _logprobs_wanted(request: api.GenerateRequest | api.ChatRequest) -> Optional[int]:
    return request.top_logprobs if request.logprobs or request.top_logprobs else None


def _logprobs(loaded: Loaded, chunk: EngineChunk) -> Optional[list[api.TokenLogprob]]:
    if not chunk.logprobs:
        return None
    piece = loaded.engine.model.token_bytes

    def entry(token: int, logprob: float) -> dict:
        raw = piece(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return [api.TokenLogprob(**entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in chunk.logprobs]


def _token_text(loaded: Loaded, token: Optional[int]) -> str:
    if token is None:
        return ""
    model = loaded.engine.model
    piece = getattr(model, "token_text", None)
    return piece(token) if piece else model.token_bytes(token).decode("utf-8", "replace")


def _messages_with_system(model: ResolvedModel, system: Optional[str],
                          messages: list[api.Message]) -> list[api.Message]:
    """Modelfile MESSAGEs first, then the system prompt (the request's, else the Modelfile's) unless the conversation
    brings its own."""
    out = list(model.messages) + list(messages)
    system_text = system if system is not None else model.system
    if system_text and not any(m.role == "system" for m in out):
        out.insert(0, api.Message(role="system", content=system_text))
    return out


def _refuse_images(images: Optional[list[str]]) -> None:
    if images:
        raise InvalidInput("images are not supported yet: no vision model backend exists in localllm",
                           hint="send text only")


def _process_row(entry: Loaded) -> api.ProcessModel:
    stats = entry.engine.snapshot()
    placement = entry.engine.model.placement
    model = entry.model
    return api.ProcessModel(
        name=model.name, model=model.name, size=model.size, digest=model.digest.removeprefix("sha256-"),
        details=model.details, expires_at=entry.expires_at, context_length=entry.engine.n_ctx,
        backend=entry.backend, slots_busy=stats.slots_busy, slots_total=stats.slots_total,
        queue_depth=stats.queue_depth, kv_type=entry.options.kv_type or "f16",
        gpu_layers=_gpu_layers(entry),
        size_vram=sum(s.total for s in placement.offload) if placement is not None else 0,
        speculation=entry.speculation.kind if entry.speculation is not None else "none",
        draft_count=stats.draft_tokens, draft_accepted=stats.accepted_tokens,
        status="removed" if entry.removed else None, placement=_placement_rows(placement))


def _gpu_layers(entry: Loaded) -> int:
    """Layers off the CPU as placed; else the num_gpu asked for (-1: the backend's "all that fit")."""
    placement = entry.engine.model.placement
    if placement is None or any(s.layers == 0 for s in placement.offload):  # llama.cpp split them itself
        return entry.options.num_gpu if entry.options.num_gpu is not None else -1
    return placement.n_gpu_layers


def _placement_rows(placement: Optional[Placement]) -> list[api.DeviceLayers]:
    if placement is None:
        return []
    return [api.DeviceLayers(device=s.device.name, description=s.device.description, layers=s.layers,
                             memory=s.total) for s in placement.shares if s.layers or s.device.kind == "cpu"]
