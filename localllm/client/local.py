"""The in-process Client: the model store plus the model pool. The REST server serves this; `localllm run` uses it
when no server is running and the CLI is asked to run in-process.

A chat request becomes a prompt here (Modelfile messages and system, then the request's messages, rendered with the
model's chat template), then tokens, then an engine submission; engine chunks become api chunks."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, BinaryIO, Generic, TypeVar

from .. import __version__, api
from ..chat.fim import FimInput, fim_prompt, require_fim
from ..chat.structured import grammar_for_format, tool_choice_grammar
from ..chat.templates import render_chat, transcript_sampling
from ..chat.thinking import (
    Split,
    Think,
    ThinkingSplitter,
    check_thinking,
    opens_thinking,
    parse_think,
    supports_thinking,
    thinking_grammar,
)
from ..chat.tool_calls import ToolCallParser
from ..engine.pool import Loaded, ModelPool
from ..engine.runner import EngineChunk, GenerationParams, Stream
from ..engine.speculative.speculation import load_speculation
from ..media import PromptImage
from ..errors import ContextOverflow, InvalidInput
from ..models.create import create_model
from ..models.info import show_model
from ..models.options import bound_sampling, resolve_options
from ..models.plan import Placement
from ..models.pull import pull_model
from ..models.store import ResolvedModel, Store
from .images import MarkedImages, mark_messages, mark_prompt, tokenize_marked

T = TypeVar("T")


class CancelToken:
    """Set from any thread; the hooks registered on it (the engine request's cancel) run once, when it is set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled, hooks, self._hooks = True, self._hooks, []
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self.cancelled:
                self._hooks.append(hook)
                return
        hook()


class RequestStream(Generic[T]):
    """A request's chunks (client/protocol.Cancellable): iterate it on one thread, cancel it from any other."""

    def __init__(self, run: Callable[[CancelToken], Iterator[T]]):
        self._token = CancelToken()
        self._chunks = run(self._token)

    def __iter__(self) -> RequestStream[T]:
        return self

    def __next__(self) -> T:
        return next(self._chunks)

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def cancel(self) -> None:
        self._token.cancel()


def _timing_fields(chunk: EngineChunk, load_seconds: float) -> dict[str, Any]:
    """Ollama's timings, adding up: load (getting the model ready, a load included) + prompt_eval (templating,
    tokenizing, waiting for a slot and the whole prefill, up to the first sampled token) + eval = total."""
    timings = chunk.timings.model_dump() if chunk.timings else {}
    load_ns = int(load_seconds * 1e9)
    timings["load_duration"] = load_ns
    timings["total_duration"] = timings.get("total_duration", 0) + load_ns
    return timings


class LocalClient:
    def __init__(self, store: Store | None = None, pool: ModelPool | None = None):
        self.store = store or Store()
        self.pool = pool or ModelPool(self.store, speculation_factory=partial(load_speculation, self.store))

    # ----------------------------------------------------------------------------------------------- models

    def version(self) -> str:
        return __version__

    def list_models(self) -> api.ListResponse:
        return api.ListResponse(models=self.store.list())

    def show(self, model: str, *, verbose: bool = False) -> api.ShowResponse:
        return show_model(self.store, model, verbose=verbose)

    def has_blob(self, digest: str) -> bool:
        return self.store.blobs.has(digest)

    def add_blob(self, digest: str, source: BinaryIO) -> None:
        self.store.blobs.add_upload(digest, source)

    def pull(self, model: str) -> Iterator[api.PullProgress]:
        return pull_model(model, self.store)

    def create(self, request: api.CreateRequest) -> Iterator[api.PullProgress]:
        return create_model(request, self.store)

    def copy(self, source: str, destination: str) -> None:
        self.store.copy(source, destination)

    def delete(self, model: str) -> None:
        """Remove the name; the loaded model goes only when no name points at it, after its running requests."""
        resolved = self.store.resolve(model)
        self.store.delete(model)
        digest = resolved.digest.removeprefix("sha256-")
        if not any(row.digest == digest for row in self.store.list()):
            self.pool.retire(resolved.digest)

    def ps(self) -> api.ProcessResponse:
        return api.ProcessResponse(models=[_process_row(e, self.pool.sharing_weights(e)) for e in self.pool.entries()])

    def stop(self, model: str) -> None:
        resolved = self.store.resolve(model)
        self.pool.unload(resolved.digest)

    def close(self) -> None:
        self.pool.close()

    # ----------------------------------------------------------------------------------------------- inference

    def generate(self, request: api.GenerateRequest) -> Iterator[api.GenerateChunk]:
        return RequestStream(lambda token: self._generate(request, token))

    def _generate(self, request: api.GenerateRequest, token: CancelToken) -> Iterator[api.GenerateChunk]:
        if not (request.prompt or request.context or request.suffix or request.input_extra or request.middle):
            # Ollama: an empty prompt loads the model (or unloads it with keep_alive 0) and answers done.
            model = self.store.resolve(request.model)
            load, _ = resolve_options(model, request.options)
            yield from self._load_only(model, load, request.keep_alive, request.model)
            return
        yield from (chunk for _, chunk in self._generate_batch([request], token))

    def generate_batch(self, requests: list[api.GenerateRequest]) -> Iterator[tuple[int, api.GenerateChunk]]:
        """Several generations with one model, admitted together (all or none): OpenAI's `n` and prompt lists.
        Answers come one request after the other, each chunk tagged with its request's index; requests with the
        same prompt prefill it once."""
        return RequestStream(lambda token: self._generate_batch(requests, token))

    def _generate_batch(
        self, requests: list[api.GenerateRequest], token: CancelToken
    ) -> Iterator[tuple[int, api.GenerateChunk]]:
        with self._admitted(requests, token, self._prepare_generate) as (loaded, prepared, streams, waited):
            for index, (request, (params, answer), stream) in enumerate(zip(requests, prepared, streams)):
                generated: list[int] = []
                for chunk in stream:
                    generated.extend(chunk.tokens)
                    # Ollama's `context`: the conversation so far as tokens, to send back with the next prompt.
                    # Ours is the prompt's tokens as sent to the engine and the answer's, so the next request finds
                    # them in the prefix cache (all but the answer's last token, never decoded).
                    # Not with images: their placeholders are no tokens a client could send back.
                    context = (
                        params.prompt + generated if chunk.done and not request.raw and not params.images else None
                    )
                    yield index, self._generate_chunk(request.model, chunk, loaded, waited, context, answer)

    @contextmanager
    def _admitted(
        self, requests: list[Any], token: CancelToken, prepare: Callable[..., tuple[Any, ...]]
    ) -> Iterator[tuple[Loaded, list[Any], list[Stream], float]]:
        """Load the requests' one model, prepare each (`prepare(loaded, model, request, ready, token)` returns its
        GenerationParams first) and submit them all in one step; yields (loaded, prepared, streams, seconds waited
        for the model). A client that leaves while its requests wait in the queue frees their places (the token),
        and one that leaves early cancels every answer still running."""
        started = time.perf_counter()
        model, load, keep_alive = self._batch_model(requests)
        with self.pool.acquire(model, load, keep_alive=keep_alive) as loaded:
            ready = time.perf_counter()
            prepared = [prepare(loaded, model, request, ready, token) for request in requests]
            streams = loaded.engine.submit_all([params for params, *_ in prepared])
            for stream in streams:
                token.on_cancel(stream.cancel)
            try:
                yield loaded, prepared, streams, ready - started
            finally:
                for stream in streams:
                    stream.cancel()

    def _batch_model(self, requests: list[Any]) -> tuple[ResolvedModel, api.LoadOptions, float | None]:
        names = {request.model for request in requests}
        if len(names) != 1:
            raise InvalidInput(f"a batch of requests must name one model, not {sorted(names)}")
        model = self.store.resolve(requests[0].model)
        load, _ = resolve_options(model, requests[0].options)
        return model, load, requests[0].keep_alive

    def _prepare_generate(
        self, loaded: Loaded, model: ResolvedModel, request: api.GenerateRequest, ready: float, token: CancelToken
    ) -> tuple[GenerationParams, _Answer]:
        if _wants_fim(loaded, request):
            return self._prepare_infill(loaded, model, request, ready)
        sampling = _bound_sampling(loaded, _generate_sampling(loaded, model, request))
        think = parse_think(request.think)
        template = _template(loaded, model, request.template)
        check_thinking(request.model, template, think)
        _require_vision(loaded, len(request.images or []))
        prompt, marks = mark_prompt(request.prompt, request.images)
        text = self._generate_text(loaded, model, request.model_copy(update={"prompt": prompt}), template, think, token)
        answer = _Answer.start(loaded, template, text, think, sampling.stop)
        context = _checked_tokens(loaded, request.context or [], "context")
        tokens, images = self._tokenize_marked(loaded, text, marks) if text else ([], ())
        params = GenerationParams(
            context + tokens,
            sampling,
            answer.grammar(grammar_for_format(request.format)),
            request.truncate,
            _logprobs_wanted(request),
            started=ready,
            keep_prefix=sampling.keep_prefix,
            images=images,
        )
        return params, answer

    @staticmethod
    def _prepare_infill(
        loaded: Loaded, model: ResolvedModel, request: api.GenerateRequest, ready: float
    ) -> tuple[GenerationParams, _Answer]:
        """Fill in the middle (chat/fim.py): the prompt is the code around the cursor between the model's FIM
        tokens, not a chat turn; the room left for the answer is kept free of it."""
        meta = loaded.engine.meta
        fim = require_fim(request.model, meta.fim)
        sampling = _bound_sampling(loaded, resolve_options(model, request.options)[1])
        text = FimInput(
            prefix=request.prompt,
            suffix=request.suffix or "",
            middle=request.middle or "",
            extra=[(f.filename, f.text) for f in request.input_extra or []],
        )
        n_ctx = loaded.engine.n_ctx
        reserve = sampling.num_predict if 0 < sampling.num_predict < n_ctx // 2 else n_ctx // 4
        tokens = fim_prompt(
            fim,
            text,
            lambda piece: loaded.engine.tokenize(piece, add_special=False, parse_special=False),
            budget=n_ctx - reserve,
            bos=meta.bos_token if meta.add_bos else None,
        )
        answer = _Answer.start(loaded, None, "", Think(), sampling.stop)
        params = GenerationParams(
            tokens,
            sampling,
            grammar_for_format(request.format),
            request.truncate,
            _logprobs_wanted(request),
            started=ready,
            keep_prefix=sampling.keep_prefix,
        )
        return params, answer

    def _generate_text(
        self,
        loaded: Loaded,
        model: ResolvedModel,
        request: api.GenerateRequest,
        template: str | None,
        think: Think,
        token: CancelToken,
    ) -> str:
        if request.raw:
            return request.prompt
        messages = _messages_with_system(model, request.system, [api.Message(role="user", content=request.prompt)])
        return self._render(loaded, model, messages, template=template, extra=think.template_variables(), token=token)

    @staticmethod
    def _generate_chunk(
        name: str, chunk: EngineChunk, loaded: Loaded, load_seconds: float, context: list[int] | None, answer: _Answer
    ) -> api.GenerateChunk:
        split = answer.feed(chunk)
        if not chunk.done:
            return api.GenerateChunk(
                model=name,
                response=split.content,
                thinking=split.thinking or None,
                tokens=list(chunk.tokens),
                logprobs=_logprobs(loaded, chunk),
            )
        return api.GenerateChunk(
            model=name,
            response=split.content,
            thinking=split.thinking or None,
            done=True,
            done_reason=chunk.done_reason,
            context=context,
            stop_sequence=answer.stop_sequence,
            **_timing_fields(chunk, load_seconds),
        )

    def chat(self, request: api.ChatRequest) -> Iterator[api.ChatChunk]:
        return RequestStream(lambda token: self._chat(request, token))

    def _chat(self, request: api.ChatRequest, token: CancelToken) -> Iterator[api.ChatChunk]:
        if not request.messages:
            model = self.store.resolve(request.model)
            load, _ = resolve_options(model, request.options)
            yield from (
                api.ChatChunk(model=c.model, done=True, done_reason=c.done_reason)
                for c in self._load_only(model, load, request.keep_alive, request.model)
            )
            return
        yield from (chunk for _, chunk in self._chat_batch([request], token))

    def chat_batch(self, requests: list[api.ChatRequest]) -> Iterator[tuple[int, api.ChatChunk]]:
        """As generate_batch, for chats (OpenAI's `n`)."""
        return RequestStream(lambda token: self._chat_batch(requests, token))

    def _chat_batch(self, requests: list[api.ChatRequest], token: CancelToken) -> Iterator[tuple[int, api.ChatChunk]]:
        for request in requests:
            if not request.messages:
                raise InvalidInput("messages is empty", hint="send at least one message")
        with self._admitted(requests, token, self._prepare_chat) as (loaded, prepared, streams, waited):
            for index, (request, (_, tools, answer), stream) in enumerate(zip(requests, prepared, streams)):
                if tools:
                    chunks = self._chat_with_tools(request.model, stream, loaded, waited, tools, answer)
                else:
                    chunks = (self._chat_chunk(request.model, c, loaded, waited, answer) for c in stream)
                for chunk in chunks:
                    yield index, chunk

    def _prepare_chat(
        self, loaded: Loaded, model: ResolvedModel, request: api.ChatRequest, ready: float, token: CancelToken
    ) -> tuple[GenerationParams, list[api.Tool] | None, _Answer]:
        _, sampling = resolve_options(model, request.options)
        grammar = grammar_for_format(request.format) or tool_choice_grammar(request.tools, request.tool_choice)
        tools = request.tools if request.tool_choice != "none" else None
        if _template(loaded, model) is None:
            sampling = transcript_sampling(sampling)
        sampling = _bound_sampling(loaded, sampling)
        tokens, answer, images = self._chat_prompt(
            loaded, model, request, tools, parse_think(request.think), sampling.stop, token
        )
        params = GenerationParams(
            tokens,
            sampling,
            answer.grammar(grammar),
            request.truncate,
            _logprobs_wanted(request),
            started=ready,
            keep_prefix=sampling.keep_prefix,
            images=images,
        )
        return params, tools, answer

    def count_tokens(self, request: api.ChatRequest) -> int:
        """The prompt tokens `request` would take (the model's template applied, tools included), loading the
        model for its tokenizer."""
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        tools = request.tools if request.tool_choice != "none" else None
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            tokens, _, _ = self._chat_prompt(loaded, model, request, tools, parse_think(request.think), [])
        return len(tokens)

    def _chat_prompt(
        self,
        loaded: Loaded,
        model: ResolvedModel,
        request: api.ChatRequest,
        tools,
        think: Think,
        stops: list[str],
        token: CancelToken | None = None,
    ) -> tuple[list[int], _Answer, tuple[PromptImage, ...]]:
        template = _template(loaded, model)
        check_thinking(request.model, template, think)
        _require_vision(loaded, sum(len(m.images or []) for m in request.messages))
        messages = _messages_with_system(model, None, request.messages)
        messages, marks = mark_messages(messages, added=len(messages) - len(request.messages))
        text = self._render(
            loaded,
            model,
            messages,
            tools=[t.model_dump() for t in tools] if tools else None,
            extra=think.template_variables(),
            token=token,
        )
        tokens, images = self._tokenize_marked(loaded, text, marks)
        return tokens, _Answer.start(loaded, template, text, think, stops, prompt_tokens=len(tokens)), images

    def _chat_with_tools(
        self, name: str, stream, loaded: Loaded, load_seconds: float, tools, answer: _Answer
    ) -> Iterator[api.ChatChunk]:
        """An answer that may call tools (chat/tool_calls.py): text that may begin a call is held until decided,
        calls stream as deltas (id and name, then pieces of the arguments), and each whole call comes in the chunk
        where it ended (as Ollama streams calls). A forced call (its grammar's bare JSON) is parsed the same way."""
        parser = ToolCallParser(tools)
        shown = 0  # calls already sent whole
        for chunk in stream:
            split = answer.feed(chunk)
            parsed = parser.feed(split.content)
            if chunk.done:
                parsed += parser.finish()
            calls, shown = parser.calls[shown:], len(parser.calls)
            message = api.Message(
                role="assistant", content=parsed.content, thinking=split.thinking or None, tool_calls=calls or None
            )
            common = {"model": name, "message": message, "tool_call_deltas": parsed.deltas or None}
            if not chunk.done:
                yield api.ChatChunk(
                    **common,
                    tokens=list(chunk.tokens),
                    logprobs=_logprobs(loaded, chunk),
                    prompt_eval_count=answer.announce(),
                )
                continue
            yield api.ChatChunk(
                **common,
                done=True,
                done_reason=chunk.done_reason,
                stop_sequence=answer.stop_sequence,
                **_timing_fields(chunk, load_seconds),
            )

    @staticmethod
    def _chat_chunk(
        name: str, chunk: EngineChunk, loaded: Loaded, load_seconds: float, answer: _Answer
    ) -> api.ChatChunk:
        split = answer.feed(chunk)
        message = api.Message(role="assistant", content=split.content, thinking=split.thinking or None)
        if not chunk.done:
            # The first chunk also says how long the prompt is, for streams that announce it before the answer
            # (Anthropic's message_start); Ollama's NDJSON leaves timing fields off all but the last chunk.
            prompt = answer.announce()
            return api.ChatChunk(
                model=name,
                message=message,
                tokens=list(chunk.tokens),
                logprobs=_logprobs(loaded, chunk),
                prompt_eval_count=prompt,
                prompt_cache_count=chunk.cached if prompt else 0,
            )
        return api.ChatChunk(
            model=name,
            message=message,
            done=True,
            done_reason=chunk.done_reason,
            stop_sequence=answer.stop_sequence,
            **_timing_fields(chunk, load_seconds),
        )

    def embed(self, request: api.EmbedRequest) -> api.EmbedResponse:
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        t0 = time.perf_counter()
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            t_loaded = time.perf_counter()
            tokenized = self._embed_inputs(loaded, request)
            vectors = loaded.engine.embed(tokenized) if tokenized else []
        if request.dimensions is not None:
            vectors = [_shorten(vector, request.dimensions) for vector in vectors]
        return api.EmbedResponse(
            model=request.model,
            embeddings=vectors,
            total_duration=int((time.perf_counter() - t0) * 1e9),
            load_duration=int((t_loaded - t0) * 1e9),
            prompt_eval_count=sum(map(len, tokenized)),
        )

    def _embed_inputs(self, loaded: Loaded, request: api.EmbedRequest) -> list[list[int]]:
        """The inputs as token lists. Ollama: "" or [] embeds nothing (the model is loaded: clients preload so)."""
        if request.input_tokens is not None:
            return [
                self._fit_embed(loaded, _checked_tokens(loaded, tokens, f"input {i}"), request.truncate)
                for i, tokens in enumerate(request.input_tokens)
            ]
        texts = [request.input] if isinstance(request.input, str) else list(request.input)
        if texts == [""]:
            return []
        for i, text in enumerate(texts):
            if not text:
                raise InvalidInput(f"input {i} is an empty string", hint="embed non-empty texts")
        return [self._fit_embed(loaded, self._tokenize(loaded, text), request.truncate) for text in texts]

    @staticmethod
    def _fit_embed(loaded: Loaded, tokens: list[int], truncate: bool) -> list[int]:
        if not tokens:
            raise InvalidInput("an input is empty", hint="embed at least one token")
        limit = loaded.engine.n_ctx
        if len(tokens) > limit:
            if not truncate:
                raise ContextOverflow(prompt_tokens=len(tokens), num_ctx=limit)
            tokens = tokens[:limit]
        return tokens

    def rerank(self, request: api.RerankRequest) -> api.RerankResponse:
        _check_rerank_texts(request)
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            pairs = _rerank_pairs(loaded, request)
            scores = loaded.engine.rerank(pairs)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n]
        used = sum(map(len, pairs))
        return api.RerankResponse(
            model=request.model,
            usage=api.RerankUsage(prompt_tokens=used, total_tokens=used),
            results=[_rerank_result(request, i, scores[i]) for i in ranked],
        )

    def save_prompt_cache(self, request: api.ChatRequest) -> bytes:
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            text = self._render(loaded, model, _messages_with_system(model, None, request.messages))
            return loaded.engine.export_prefix(self._tokenize(loaded, text))

    def load_prompt_cache(self, request: api.ChatRequest, data: bytes) -> int:
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            return loaded.engine.import_prefix(data)

    # ----------------------------------------------------------------------------------------------- helpers

    def _load_only(
        self, model: ResolvedModel, load: api.LoadOptions, keep_alive: float | None, name: str
    ) -> Iterator[api.GenerateChunk]:
        with self.pool.acquire(model, load, keep_alive=keep_alive):
            pass
        reason = "unload" if keep_alive is not None and keep_alive <= 0 else "load"
        yield api.GenerateChunk(model=name, done=True, done_reason=reason)

    def _render(
        self,
        loaded: Loaded,
        model: ResolvedModel,
        messages: list[api.Message],
        *,
        template: str | None = None,
        tools: list | None = None,
        extra: dict[str, Any] | None = None,
        token: CancelToken | None = None,
    ) -> str:
        meta = loaded.engine.meta
        return render_chat(
            _template(loaded, model, template),
            [m.model_dump(exclude_none=True) for m in messages],
            tools=tools,
            bos_token=_token_text(loaded, meta.bos_token),
            eos_token=_token_text(loaded, meta.eos_token),
            extra=extra,
            cancelled=(lambda: token.cancelled) if token is not None else None,
        )

    @classmethod
    def _tokenize_marked(
        cls, loaded: Loaded, text: str, marks: MarkedImages | None
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt's tokens and its images (their marks replaced by each image's piece)."""
        if marks is None:
            return cls._tokenize(loaded, text), ()

        def tokenize(piece: str, first: bool) -> list[int]:
            return cls._tokenize(loaded, piece) if first else loaded.engine.tokenize(piece, add_special=False)

        return tokenize_marked(text, marks, tokenize, loaded.engine.image_tokens)

    @staticmethod
    def _tokenize(loaded: Loaded, text: str) -> list[int]:
        meta = loaded.engine.meta
        bos = _token_text(loaded, meta.bos_token)
        # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
        add_special = not (bos and text.startswith(bos))
        return loaded.engine.tokenize(text, add_special=add_special, parse_special=True)


def _template(loaded: Loaded, model: ResolvedModel, override: str | None = None) -> str | None:
    """The chat template a prompt is rendered with; None means the plain transcript (a base model)."""
    return override or model.template or loaded.engine.meta.chat_template


class _Answer:
    """One answer on its way out: its thinking split from its content, and which stop string ended it."""

    def __init__(
        self, loaded: Loaded, splitter: ThinkingSplitter | None, thinks: bool, stops: list[str], prompt_tokens: int = 0
    ):
        self._loaded = loaded
        self._prompt_tokens = prompt_tokens
        self._splitter = splitter
        self._thinks = thinks
        self._stops = sorted(s for s in stops if s)
        self._text: list[str] = []
        self._tokens: list[int] = []
        self.stop_sequence: str | None = None

    @classmethod
    def start(
        cls,
        loaded: Loaded,
        template: str | None,
        prompt: str,
        think: Think,
        stops: list[str],
        *,
        prompt_tokens: int = 0,
    ) -> _Answer:
        # A reasoning model's tags are always split off, even when thinking was turned off and it thinks anyway.
        capable = supports_thinking(template)
        splitter = ThinkingSplitter(opened=opens_thinking(prompt)) if capable else None
        return cls(loaded, splitter, capable and think.enabled is not False, stops, prompt_tokens)

    def announce(self) -> int:
        """The prompt's length the first time, 0 after."""
        count, self._prompt_tokens = self._prompt_tokens, 0
        return count

    def grammar(self, grammar: str | None) -> str | None:
        """Structured output on a thinking answer applies after the think block (as Ollama does)."""
        if grammar is None or not self._thinks or self._splitter is None:
            return grammar
        return thinking_grammar(grammar, opened=self._splitter.thinking)

    def feed(self, chunk: EngineChunk) -> Split:
        self._text.append(chunk.text)
        self._tokens.extend(chunk.tokens)
        if self._splitter is None:
            split = Split(content=chunk.text)
        else:
            split = self._splitter.feed(chunk.text)
            if chunk.done:
                tail = self._splitter.flush()
                split = Split(split.thinking + tail.thinking, split.content + tail.content)
        if chunk.done and chunk.done_reason == "stop" and self._stops:
            self.stop_sequence = self._matched_stop()
        return split

    def _matched_stop(self) -> str | None:
        # The engine hides the stop string; what the answer's tokens spell beyond the text shown begins with it.
        spelled = b"".join(self._loaded.engine.token_bytes(t) for t in self._tokens).decode("utf-8", "replace")
        rest = spelled[len("".join(self._text)) :]
        return next((s for s in self._stops if rest.startswith(s)), None)


def _bound_sampling(loaded: Loaded, sampling: api.SamplingOptions) -> api.SamplingOptions:
    return bound_sampling(sampling, n_ctx=loaded.engine.n_ctx, n_vocab=loaded.engine.meta.n_vocab)


def _logprobs_wanted(request: api.GenerateRequest | api.ChatRequest) -> int | None:
    return request.top_logprobs if request.logprobs or request.top_logprobs else None


def _logprobs(loaded: Loaded, chunk: EngineChunk) -> list[api.TokenLogprob] | None:
    if not chunk.logprobs:
        return None
    piece = loaded.engine.token_bytes

    def entry(token: int, logprob: float) -> dict:
        raw = piece(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return [
        api.TokenLogprob(**entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
        for lp in chunk.logprobs
    ]


def _token_text(loaded: Loaded, token: int | None) -> str:
    return "" if token is None else loaded.engine.token_text(token)


def _messages_with_system(model: ResolvedModel, system: str | None, messages: list[api.Message]) -> list[api.Message]:
    """Modelfile MESSAGEs first, then the system prompt (the request's, else the Modelfile's) unless the conversation
    brings its own."""
    out = list(model.messages) + list(messages)
    system_text = system if system is not None else model.system
    if system_text and not any(m.role == "system" for m in out):
        out.insert(0, api.Message(role="system", content=system_text))
    return out


def _check_rerank_texts(request: api.RerankRequest) -> None:
    """Refuse what llama.cpp would score as nothing: an empty query, no documents, an empty document."""
    if not request.query:
        raise InvalidInput("query is empty", hint="send the text the documents are ranked against")
    if not request.documents:
        raise InvalidInput("documents is empty", hint="send at least one document to rank")
    for i, document in enumerate(request.documents):
        if not document:
            raise InvalidInput(f"document {i} is an empty string", hint="rank non-empty texts")


def _rerank_pairs(loaded: Loaded, request: api.RerankRequest) -> list[list[int]]:
    """Each document's pair with the query as the reranker reads it, each within the context (as llama-server
    refuses a longer pair rather than cut it)."""
    if not loaded.engine.meta.reranker:
        raise InvalidInput(
            f"model {request.model!r} does not rerank: it has no classifier head (rank pooling)",
            hint="rerank with a cross-encoder GGUF (e.g. bge-reranker-v2-m3); /v1/embeddings embeds texts",
        )
    limit = loaded.engine.n_ctx
    pairs = []
    for i, document in enumerate(request.documents):
        tokens = loaded.engine.pair_tokens(request.query, document)
        if len(tokens) > limit:
            raise InvalidInput(
                f"document {i} with the query is {len(tokens)} tokens but the context holds {limit}",
                hint="shorten the document or the query, or raise num_ctx up to the model's trained context",
            )
        pairs.append(tokens)
    return pairs


def _rerank_result(request: api.RerankRequest, index: int, score: float) -> api.RerankResult:
    document = api.RerankDocument(text=request.documents[index]) if request.return_documents else None
    return api.RerankResult(index=index, relevance_score=score, document=document)


def _checked_tokens(loaded: Loaded, tokens: list[int], what: str) -> list[int]:
    """Token ids from the client, checked against the vocabulary before they reach native code."""
    n_vocab = loaded.engine.meta.n_vocab
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidInput(f"{what} holds token id {bad}, outside the model's vocabulary of {n_vocab}")
    return list(tokens)


def _shorten(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` values, scaled back to unit length (Ollama's and OpenAI's `dimensions`)."""
    if dimensions > len(vector):
        raise InvalidInput(
            f"dimensions {dimensions} is more than the model's {len(vector)}", hint=f"ask for at most {len(vector)}"
        )
    head = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in head))
    return [v / norm for v in head] if norm > 0 else head


def _require_vision(loaded: Loaded, n_images: int) -> None:
    """Refuse images for a model without a vision projector, before decoding any (Ollama's wording)."""
    if n_images and not loaded.engine.meta.vision:
        raise InvalidInput(
            "this model is missing data required for image input",
            hint=f"{loaded.model.name} has no vision projector; use a model whose `localllm show` lists vision",
        )


def _process_row(entry: Loaded, sharing: list[str]) -> api.ProcessModel:
    stats = entry.engine.snapshot()
    placement = entry.engine.placement
    model = entry.model
    return api.ProcessModel(
        name=model.name,
        model=model.name,
        size=model.size,
        digest=model.digest.removeprefix("sha256-"),
        details=model.details,
        expires_at=entry.expires_at,
        context_length=entry.engine.n_ctx,
        backend=entry.backend,
        slots_busy=stats.slots_busy,
        slots_total=stats.slots_total,
        queue_depth=stats.queue_depth,
        kv_type=entry.options.kv_type or "f16",
        gpu_layers=_gpu_layers(entry),
        size_vram=sum(s.total for s in placement.offload) if placement is not None else 0,
        speculation=entry.speculation.kind if entry.speculation is not None else "none",
        threads=stats.threads,
        threads_auto=entry.engine.threads is not None,
        flash_attn=entry.options.flash_attn if entry.measured_flash_attn is None else entry.measured_flash_attn,
        flash_attn_measured=entry.measured_flash_attn is not None,
        draft_count=stats.draft_tokens,
        draft_accepted=stats.accepted_tokens,
        draft=entry.speculation.draft_row() if entry.speculation is not None else None,
        status="removed" if entry.removed else None,
        kv_cells=stats.kv_cells,
        kv_used=stats.kv_used,
        cache_ram_bytes=stats.cache_ram_bytes,
        cache_ram_limit=stats.cache_ram_limit,
        cache_disk_bytes=stats.cache_disk_bytes,
        cache_disk_limit=stats.cache_disk_limit,
        prefix_cache_hits=dict(stats.prefix_hits),
        prefix_cache_tokens=dict(stats.prefix_tokens),
        shares_weights_with=sharing,
        placement=_placement_rows(placement),
        missing_workers=list(placement.missing_workers) if placement else [],
    )


def _wants_fim(loaded: Loaded, request: api.GenerateRequest) -> bool:
    """A suffix (or /infill's other fields) asks for fill in the middle; an empty suffix only of a model that can,
    as Ollama then answers the plain prompt."""
    if request.suffix or request.input_extra or request.middle:
        return True
    return request.suffix is not None and loaded.engine.meta.fim is not None


def _generate_sampling(loaded: Loaded, model: ResolvedModel, request: api.GenerateRequest) -> api.SamplingOptions:
    """A generate request's sampling: a base model's transcript gets its turn stops and a cap (transcript_sampling)."""
    sampling = resolve_options(model, request.options)[1]
    if not request.raw and _template(loaded, model, request.template) is None:
        sampling = transcript_sampling(sampling)
    return sampling


def _gpu_layers(entry: Loaded) -> int:
    """Layers off the CPU as placed; else the num_gpu asked for (-1: the backend's "all that fit")."""
    placement = entry.engine.placement
    if placement is None or any(s.layers == 0 for s in placement.offload):  # llama.cpp split them itself
        return entry.options.num_gpu if entry.options.num_gpu is not None else -1
    return placement.n_gpu_layers


def _placement_rows(placement: Placement | None) -> list[api.DeviceLayers]:
    if placement is None:
        return []
    return [
        api.DeviceLayers(device=s.device.name, description=s.device.description, layers=s.layers, memory=s.total)
        for s in placement.shares
        if s.layers or s.device.kind == "cpu"
    ]
