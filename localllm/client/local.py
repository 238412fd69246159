"""The in-process Client: the model store plus the model pool. The REST server serves this; `localllm run` uses it
when no server is running and the CLI is asked to run in-process.

LocalClient coordinates; the work is in rooms of its own: a chat request becomes a prompt in prompts.py (Modelfile
messages and system, then the request's messages, rendered with the model's chat template, then tokens), an engine
submission here, and its engine chunks become api chunks in answer.py. Embeddings and rerank are in pooling.py, the
`ps` rows in ps.py, the cancellable streams in streams.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, BinaryIO

from .. import __version__, api
from ..chat.call_formats import LazyGrammar, call_format, lazy_call_grammar
from ..chat.fim import require_fim
from ..chat.structured import grammar_for_format, tool_choice_grammar
from ..chat.templates import transcript_sampling
from ..chat.thinking import Think, check_thinking, parse_think
from ..engine.planning import plan_response, plan_with_draft
from ..engine.pool import Loaded, ModelPool
from ..engine.runner import GenerationParams, Stream
from ..engine.speculative.speculation import load_speculation
from ..errors import InvalidInput
from ..media import PromptImage
from ..models.create import create_model
from ..models.info import show_model
from ..models.options import bound_sampling, request_context, resolve_options
from ..models.pull import pull_model
from ..models.store import ResolvedModel, Store
from . import pooling, prompts
from .answer import Answer, chat_chunk, chat_with_tools, generate_chunk
from .images import mark_prompt
from .protocol import Admission, RequestStream
from .ps import process_row
from .streams import CancelToken, TokenStream, until_cancelled


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

    def pull(self, model: str) -> RequestStream[api.PullProgress]:
        return TokenStream(lambda token: until_cancelled(pull_model(model, self.store), token))

    def create(self, request: api.CreateRequest) -> RequestStream[api.PullProgress]:
        return TokenStream(lambda token: until_cancelled(create_model(request, self.store), token))

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
        rows = [process_row(e, self.pool.sharing_weights(e)) for e in self.pool.entries()]
        return api.ProcessResponse(models=rows, load_queue=self.pool.waiting())

    def stop(self, model: str) -> None:
        resolved = self.store.resolve(model)
        self.pool.unload(resolved.digest)

    def plan(self, request: api.PlanRequest) -> api.PlanResponse:
        return plan_response(plan_with_draft(self.store, request.model, request.options))

    def close(self) -> None:
        self.pool.close()

    # ----------------------------------------------------------------------------------------------- generate

    def generate(self, request: api.GenerateRequest) -> RequestStream[api.GenerateChunk]:
        return TokenStream(lambda token: self._generate(request, token))

    def _generate(self, request: api.GenerateRequest, token: CancelToken) -> Generator[api.GenerateChunk, None, None]:
        infill = request.middle is not None  # /infill's: even an empty one is answered (or refused) as infill
        if not (request.prompt or request.context or request.suffix or request.input_extra or infill):
            # Ollama: an empty prompt loads the model (or unloads it with keep_alive 0) and answers done.
            model = self.store.resolve(request.model)
            load, _ = resolve_options(model, request.options)
            yield from self._load_only(model, load, request.keep_alive, request.model)
            return
        yield from (chunk for _, chunk in self._generate_batch([request], token))

    def generate_batch(self, requests: list[api.GenerateRequest]) -> RequestStream[tuple[int, api.GenerateChunk]]:
        """Several generations with one model, admitted together (all or none): OpenAI's `n` and prompt lists.
        Answers come one request after the other, each chunk tagged with its request's index; requests with the
        same prompt prefill it once."""
        return TokenStream(lambda token: self._generate_batch(requests, token))

    def _generate_batch(
        self, requests: list[api.GenerateRequest], token: CancelToken
    ) -> Generator[tuple[int, api.GenerateChunk], None, None]:
        with self._admitted(requests, token, self._prepare_generate) as (prepared, streams, waited):
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
                    yield index, generate_chunk(request.model, chunk, answer, waited, context)

    @staticmethod
    def _prepare_generate(
        loaded: Loaded,
        model: ResolvedModel,
        request: api.GenerateRequest,
        sampling: api.SamplingOptions,
        ready: float,
        token: CancelToken,
        n_ctx: int,
    ) -> tuple[GenerationParams, Answer]:
        prompts.check_text_size(prompts.generate_chars(request), n_ctx, "the prompt")
        if prompts.wants_fim(request, loaded.engine.meta.fim is not None):
            return _prepare_infill(loaded, request, _bound_sampling(loaded, sampling, n_ctx), ready, n_ctx)
        prompt = _prompt_model(loaded, model, request.template)
        if not request.raw and prompt.template is None:
            sampling = transcript_sampling(sampling)  # a base model's transcript: its turn stops and a cap
        sampling = _bound_sampling(loaded, sampling, n_ctx)
        think = parse_think(request.think)
        check_thinking(request.model, prompt.template, think)
        prompts.require_vision(loaded.engine.meta.vision, loaded.model.name, len(request.images or []))
        text, marks = mark_prompt(request.prompt, request.images)
        marked = request.model_copy(update={"prompt": text})
        rendered = prompts.generate_text(prompt, model, marked, think, lambda: token.cancelled)
        answer = Answer.start(loaded.engine.token_bytes, prompt.template, rendered.shown, think, sampling.stop)
        context = prompts.checked_tokens(request.context or [], loaded.engine.meta.n_vocab, "context")
        tokens, images = prompts.tokenize_with_images(prompt, rendered, marks) if rendered.text else ([], ())
        params = GenerationParams(
            context + tokens,
            sampling,
            answer.grammar(grammar_for_format(request.format)),
            request.truncate,
            _logprobs_wanted(request),
            started=ready,
            keep_prefix=sampling.keep_prefix,
            images=images,
            n_ctx=n_ctx,
        )
        return params, answer

    # ----------------------------------------------------------------------------------------------- chat

    def chat(self, request: api.ChatRequest) -> RequestStream[api.ChatChunk]:
        return TokenStream(lambda token: self._chat(request, token))

    def _chat(self, request: api.ChatRequest, token: CancelToken) -> Generator[api.ChatChunk, None, None]:
        if not request.messages:
            model = self.store.resolve(request.model)
            load, _ = resolve_options(model, request.options)
            yield from (
                api.ChatChunk(model=c.model, done=True, done_reason=c.done_reason)
                for c in self._load_only(model, load, request.keep_alive, request.model)
            )
            return
        yield from (chunk for _, chunk in self._chat_batch([request], token))

    def chat_batch(self, requests: list[api.ChatRequest]) -> RequestStream[tuple[int, api.ChatChunk]]:
        """As generate_batch, for chats (OpenAI's `n`)."""
        return TokenStream(lambda token: self._chat_batch(requests, token))

    def _chat_batch(
        self, requests: list[api.ChatRequest], token: CancelToken
    ) -> Generator[tuple[int, api.ChatChunk], None, None]:
        for request in requests:
            if not request.messages:
                raise InvalidInput("messages is empty", hint="send at least one message")
            prompts.check_message_count(request.messages)
        with self._admitted(requests, token, self._prepare_chat) as (prepared, streams, waited):
            for index, (request, (_, tools, answer), stream) in enumerate(zip(requests, prepared, streams)):
                if tools:
                    chunks = chat_with_tools(request.model, stream, answer, waited, tools)
                else:
                    chunks = (chat_chunk(request.model, c, answer, waited) for c in stream)
                for chunk in chunks:
                    yield index, chunk

    @staticmethod
    def _prepare_chat(
        loaded: Loaded,
        model: ResolvedModel,
        request: api.ChatRequest,
        sampling: api.SamplingOptions,
        ready: float,
        token: CancelToken,
        n_ctx: int,
    ) -> tuple[GenerationParams, list[api.Tool] | None, Answer]:
        grammar = grammar_for_format(request.format) or tool_choice_grammar(request.tools, request.tool_choice)
        tools = request.tools if request.tool_choice != "none" else None
        template = _prompt_model(loaded, model).template
        if template is None:
            sampling = transcript_sampling(sampling)
        sampling = _bound_sampling(loaded, sampling, n_ctx)
        tokens, answer, images = _chat_prompt(loaded, model, request, tools, sampling.stop, token)
        lazy = None
        if grammar is None and tools and not answer.thinks:
            lazy = _lazy_call_grammar(tools, template, parallel=request.parallel_tool_calls)
        params = GenerationParams(
            tokens,
            sampling,
            lazy.grammar if lazy else answer.grammar(grammar),
            request.truncate,
            _logprobs_wanted(request),
            started=ready,
            grammar_triggers=lazy.triggers if lazy else None,
            keep_prefix=sampling.keep_prefix,
            images=images,
            n_ctx=n_ctx,
        )
        return params, tools, answer

    def count_tokens(self, request: api.ChatRequest) -> int:
        """The prompt tokens `request` would take (the model's template applied, tools included), loading the
        model for its tokenizer."""
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        tools = request.tools if request.tool_choice != "none" else None
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            tokens, _, _ = _chat_prompt(loaded, model, request, tools, [])
        return len(tokens)

    # ----------------------------------------------------------------------------------------------- admission

    @contextmanager
    def _admitted(
        self, requests: list[Any], token: CancelToken, prepare: Callable[..., tuple[Any, ...]]
    ) -> Iterator[tuple[list[Any], list[Stream], float]]:
        """Load the requests' one model, prepare each (`prepare(loaded, model, request, sampling, ready, token, n_ctx)`
        returns its GenerationParams first; n_ctx is the requests' own context) and submit them all in one step; yields
        (prepared, streams, seconds waited for the model). A client that leaves while its requests wait in the queue
        frees their places (the token), and one that leaves early cancels every answer still running. The engine's
        opening of the first request is the stream's admission (a server sends its headers then, not after the
        prefill)."""
        started = time.perf_counter()
        model, load, samplings = self._batch_options(requests)
        with self.pool.acquire(model, load, keep_alive=requests[0].keep_alive) as loaded:
            ready = time.perf_counter()
            n_ctx = request_context(loaded.engine.n_ctx, load)
            prepared = [prepare(loaded, model, r, s, ready, token, n_ctx) for r, s in zip(requests, samplings)]
            streams = loaded.engine.submit_all([params for params, *_ in prepared])
            for stream in streams:
                token.on_cancel(stream.cancel)
            streams[0].on_open(lambda opening: token.admitted(Admission(opening.prompt_tokens, opening.cached)))
            try:
                yield prepared, streams, ready - started
            finally:
                for stream in streams:
                    stream.cancel()

    def _batch_options(self, requests: list[Any]) -> tuple[ResolvedModel, api.LoadOptions, list[api.SamplingOptions]]:
        """The batch's one model and the options it loads with, and each request's sampling: every request's
        options resolved once, here, the sampling half handed on to its prepare step."""
        names = {request.model for request in requests}
        if len(names) != 1:
            raise InvalidInput(f"a batch of requests must name one model, not {sorted(names)}")
        model = self.store.resolve(requests[0].model)
        resolved = [resolve_options(model, request.options) for request in requests]
        loads = [load for load, _ in resolved]
        _check_one_load(loads)
        return model, loads[0], [sampling for _, sampling in resolved]

    def _load_only(
        self, model: ResolvedModel, load: api.LoadOptions, keep_alive: float | None, name: str
    ) -> Iterator[api.GenerateChunk]:
        with self.pool.acquire(model, load, keep_alive=keep_alive):
            pass
        reason = "unload" if keep_alive is not None and keep_alive <= 0 else "load"
        yield api.GenerateChunk(model=name, done=True, done_reason=reason)

    # ----------------------------------------------------------------------------------------------- pooling

    def embed(self, request: api.EmbedRequest, cancelled: Callable[[], bool] = lambda: False) -> api.EmbedResponse:
        pooling.check_embed_inputs(request)
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        t0 = time.perf_counter()
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            t_loaded = time.perf_counter()
            prompt = _prompt_model(loaded, model)
            tokenize = partial(prompts.tokenize_text, prompt)
            n_ctx = request_context(loaded.engine.n_ctx, load)
            vectors, tokenized = pooling.embed_vectors(loaded.engine, request, tokenize, cancelled, n_ctx)
        return api.EmbedResponse(
            model=request.model,
            embeddings=vectors,
            total_duration=int((time.perf_counter() - t0) * 1e9),
            load_duration=int((t_loaded - t0) * 1e9),
            prompt_eval_count=sum(map(len, tokenized)),
        )

    def rerank(self, request: api.RerankRequest) -> api.RerankResponse:
        pooling.check_rerank_texts(request)
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            pairs = pooling.rerank_pairs(loaded.engine, request, request_context(loaded.engine.n_ctx, load))
            scores = loaded.engine.rerank(pairs)
        return pooling.rerank_response(request, pairs, scores)

    # ----------------------------------------------------------------------------------------------- prompt cache

    def save_prompt_cache(self, request: api.ChatRequest) -> bytes:
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            prompt = _prompt_model(loaded, model)
            prompts.check_message_count(request.messages)
            prompts.check_text_size(prompts.message_chars(request.messages), loaded.engine.n_ctx, "the conversation")
            rendered = prompts.render(prompt, prompts.messages_with_system(model, None, request.messages))
            return loaded.engine.export_prefix(prompts.tokenize_prompt(prompt, rendered.text, rendered.typed))

    def load_prompt_cache(self, request: api.ChatRequest, data: bytes) -> int:
        model = self.store.resolve(request.model)
        load, _ = resolve_options(model, request.options)
        with self.pool.acquire(model, load, keep_alive=request.keep_alive) as loaded:
            return loaded.engine.import_prefix(data)


def _prompt_model(loaded: Loaded, model: ResolvedModel, template: str | None = None) -> prompts.PromptModel:
    """What prompts.py reads of the loaded model; `template` is a request's own (generate's `template`)."""
    engine = loaded.engine
    meta = engine.meta
    return prompts.PromptModel(
        template=prompts.chat_template(model, meta.chat_template, template),
        bos=_token_text(loaded, meta.bos_token),
        eos=_token_text(loaded, meta.eos_token),
        tokenize=engine.tokenize,
        token_text=engine.token_text,
        image_tokens=engine.image_tokens,
    )


def _lazy_call_grammar(tools: list[api.Tool], template: str | None, *, parallel: bool) -> LazyGrammar | None:
    """Calls constrained once begun; tools whose schemas no grammar holds are left to the parser, as before."""
    try:
        return lazy_call_grammar(tools, call_format(template), parallel=parallel)
    except InvalidInput:
        return None


def _chat_prompt(
    loaded: Loaded,
    model: ResolvedModel,
    request: api.ChatRequest,
    tools: list[api.Tool] | None,
    stops: list[str],
    token: CancelToken | None = None,
) -> tuple[list[int], Answer, tuple[PromptImage, ...]]:
    """A chat's prompt tokens, its images, and the answer that reads its output."""
    prompts.check_message_count(request.messages)
    prompts.check_text_size(prompts.message_chars(request.messages), loaded.engine.n_ctx, "the conversation")
    prompt = _prompt_model(loaded, model)
    think = parse_think(request.think)
    check_thinking(request.model, prompt.template, think)
    prompts.require_vision(
        loaded.engine.meta.vision, loaded.model.name, sum(len(m.images or []) for m in request.messages)
    )
    cancelled = (lambda: token.cancelled) if token is not None else None
    rendered, marks = prompts.chat_text(prompt, model, request.messages, tools, think, cancelled)
    tokens, images = prompts.tokenize_with_images(prompt, rendered, marks)
    answer = Answer.start(
        loaded.engine.token_bytes, prompt.template, rendered.shown, think, stops, prompt_tokens=len(tokens)
    )
    return tokens, answer, images


def _prepare_infill(
    loaded: Loaded, request: api.GenerateRequest, sampling: api.SamplingOptions, ready: float, n_ctx: int
) -> tuple[GenerationParams, Answer]:
    meta = loaded.engine.meta
    fim = require_fim(request.model, meta.fim)
    tokens = prompts.infill_tokens(
        fim,
        request,
        loaded.engine.tokenize,
        n_ctx=n_ctx,
        num_predict=sampling.num_predict,
        bos=meta.bos_token if meta.add_bos else None,
    )
    answer = Answer.start(loaded.engine.token_bytes, None, "", Think(), sampling.stop)
    params = GenerationParams(
        tokens,
        sampling,
        grammar_for_format(request.format),
        request.truncate,
        _logprobs_wanted(request),
        started=ready,
        keep_prefix=sampling.keep_prefix,
        n_ctx=n_ctx,
    )
    return params, answer


def _check_one_load(loads: list[api.LoadOptions]) -> None:
    """A batch is admitted on one load of its model: requests that would load it differently cannot share it."""
    first = loads[0].model_dump()
    differ = sorted({name for load in loads[1:] for name, value in load.model_dump().items() if value != first[name]})
    if differ:
        raise InvalidInput(
            f"a batch of requests must load its model one way, but its requests differ in {', '.join(differ)}",
            hint="give every request of the batch the same load options (num_ctx, num_gpu, ...)",
        )


def _bound_sampling(loaded: Loaded, sampling: api.SamplingOptions, n_ctx: int) -> api.SamplingOptions:
    return bound_sampling(sampling, n_ctx=n_ctx, n_vocab=loaded.engine.meta.n_vocab)


def _logprobs_wanted(request: api.GenerateRequest | api.ChatRequest) -> int | None:
    return request.top_logprobs if request.logprobs or request.top_logprobs else None


def _token_text(loaded: Loaded, token: int | None) -> str:
    return "" if token is None else loaded.engine.token_text(token)
