"""The engine thread: the one owner of a loaded model's native context.

Everything else talks to it through plain values: `submit()` puts a request on the inbox and returns a Stream that
yields EngineChunks from an outbox; exceptions cross as values too. The loop is schedule → decode → sample → update →
emit, built from named steps."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .. import config
from ..api import GrammarTriggers, SamplingOptions, Timings
from ..backends.base import LoadedModel, ModelMeta
from ..errors import Cancelled, ContextOverflow, InvalidInput, LocalLLMError, QueueFull, WorkerLost
from ..media import ImagePixels, PromptImage, is_placeholder
from .cache_keeper import CacheKeeper
from .embed_queue import EmbedJob, EmbedQueue
from .parts import embedder_of, reranker_of, vision_of
from .prefix_cache import PrefixCache
from .scheduler import Request, Scheduler, Step
from .speculative.speculation import Speculation
from .step_budget import Pacing, StepBudget
from .text import TextStream
from .threads import StepKind, ThreadTuner

if TYPE_CHECKING:
    from ..models.plan import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineChunk:
    """A piece of a generation. The last one has done=True, a done_reason and the timings."""

    text: str = ""
    tokens: tuple[int, ...] = ()
    done: bool = False
    done_reason: str | None = None
    timings: Timings | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    cached: int = 0  # prompt tokens the prefix cache served, known from the first chunk on (Anthropic's message_start)


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability under the model (before sampling filters) and the top alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationParams:
    prompt: list[int]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    grammar: str | None = None
    truncate: bool = False
    logprobs: int | None = None  # None: none; n: the chosen token's and the n most likely alternatives
    started: float | None = None  # perf_counter when the request began (prompt_eval counts from here); None: now
    keep_prefix: bool = False  # pin the prompt and answer in the prefix cache when the request ends
    images: tuple[PromptImage, ...] = ()  # images whose placeholders the prompt holds (Vision.image_tokens)
    n_ctx: int | None = None  # the request's own context, where it asked for less than the loaded model holds
    grammar_triggers: GrammarTriggers | None = None  # the grammar waits for one (chat/call_formats.py)


ACCEPTANCE_POSITIONS = 64  # draft positions counted one by one; later ones count in the last


@dataclass
class EngineStats:
    slots_total: int = 0
    slots_busy: int = 0
    queue_depth: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0  # verification steps that carried drafts: accepted_tokens / draft_steps is the mean run
    decode_seconds: float = 0.0
    threads: int = 0  # CPU threads of the last decode-only step (0: the backend chooses)
    embedded_inputs: int = 0  # inputs embedded since the load
    embeds_dropped: int = 0  # embedding requests dropped unfinished because their client left
    # The prefix cache, by tier ("slot", "ram", "disk"): requests that reused a prefix and the tokens they skipped.
    prefix_hits: dict[str, int] = field(default_factory=lambda: {"slot": 0, "ram": 0, "disk": 0})
    prefix_tokens: dict[str, int] = field(default_factory=lambda: {"slot": 0, "ram": 0, "disk": 0})
    cache_ram_bytes: int = 0
    cache_ram_limit: int = 0
    cache_disk_bytes: int = 0
    cache_disk_limit: int = 0
    kv_cells: int = 0  # KV cells the slots share (n_slots x n_ctx where each slot has its own)
    kv_used: int = 0  # cells the slots' caches hold now
    # Speculation: draft positions (0 = the first draft token) the target verified, and how many it accepted there.
    verified_at: list[int] = field(default_factory=lambda: [0] * ACCEPTANCE_POSITIONS)
    accepted_at: list[int] = field(default_factory=lambda: [0] * ACCEPTANCE_POSITIONS)


@dataclass(frozen=True)
class Opening:
    """The engine has taken a request: its prompt's tokens and those the prefix cache serves (None while the request
    waits for a slot). It comes before the first chunk, so that a stream can open before the prefill ends."""

    prompt_tokens: int
    cached: int | None


class Stream:
    """What submit() returns: iterate for chunks; cancel() (or closing the iterator) frees the slot next step."""

    def __init__(self, request: Request, outbox: queue.SimpleQueue):
        self._request = request
        self._outbox = outbox
        self._opened: Callable[[Opening], None] | None = None
        self.done = False

    def on_open(self, hook: Callable[[Opening], None]) -> None:
        """Call `hook` with the request's Opening, on the thread that iterates, when the iteration reaches it."""
        self._opened = hook

    def __iter__(self) -> Iterator[EngineChunk]:
        try:
            while not self.done:
                item = self._outbox.get()
                if isinstance(item, BaseException):
                    self.done = True
                    raise item
                if isinstance(item, Opening):
                    if self._opened is not None:
                        self._opened(item)
                    continue
                self.done = item.done
                yield item
        finally:
            if not self.done:
                self.cancel()

    def cancel(self) -> None:
        self._request.cancelled = True


@dataclass
class _Output:
    """Per-request engine-side state: where chunks go, the text stream, and timing marks."""

    outbox: queue.SimpleQueue
    text: TextStream
    truncated: int = 0
    logprobs: int | None = None
    pending_logprobs: list = field(default_factory=list)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    # Where a speculating request's time goes: its drafter, the steps that verified its drafts, sampling its rows.
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    sample_seconds: float = 0.0


_Job = Request[_Output]  # a request as the engine thread holds it: the scheduler's Request with its output sink


# Inbox commands: the only values that cross into the engine thread.
@dataclass(frozen=True)
class _Submit:
    admitted: list[tuple[_Job, GenerationParams]]


@dataclass(frozen=True)
class _Embed:
    job: EmbedJob


@dataclass(frozen=True)
class _Rerank:
    pairs: list[list[int]]
    future: Future[list[float]]


@dataclass(frozen=True)
class _Export:
    tokens: list[int]
    future: Future[bytes]


@dataclass(frozen=True)
class _Import:
    blob: bytes
    future: Future[int]


@dataclass(frozen=True)
class _Close:
    pass


_Command = _Submit | _Embed | _Rerank | _Export | _Import | _Close


def _top_indices(logits: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest logits, largest first, without sorting the whole vocabulary (262k for gemma3)."""
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    n = min(n, logits.shape[0])
    part = np.argpartition(-logits, n - 1)[:n]
    return part[np.argsort(-logits[part])]


def _share_prefills(requests: list[Request]) -> None:
    """Requests of one batch with the same prompt (OpenAI's n) prefill it once: each follows the first, waiting for
    its prefill and then copying its KV cache."""
    first: dict[tuple[int, ...], Request] = {}
    for request in requests:
        leader = first.setdefault(tuple(request.prompt), request)
        if leader is not request:
            request.follows = leader


class ModelEngine:
    def __init__(
        self,
        model: LoadedModel,
        *,
        max_queue: int,
        num_batch: int | None = None,
        load_seconds: float = 0.0,
        speculation: Speculation | None = None,
        threads: ThreadTuner | None = None,
        pinned_threads: int = 0,
        prefix_cache: PrefixCache | None = None,
        pacing: Pacing | None = None,
    ):
        self.model = model
        self.n_slots = model.n_seq
        self.n_ctx = model.n_ctx
        self.load_seconds = load_seconds
        self.max_queue = max_queue
        # Builds each request's drafter, follows every decode, learns what a step costs (its draft windows weigh
        # that) and is freed with the model.
        self.speculation = speculation
        self.threads = threads  # None: the count is pinned (or the backend schedules its own threads)
        self._threads_now = 0
        self._machine_changed = threading.Event()  # set by any thread, read by this engine's before a step
        self._all_deterministic = config.DETERMINISTIC.get()  # a server for evaluation runs: every request
        # Prefixes evicted from the slots, in RAM and on disk (engine/prefix_cache.py); only this thread touches it.
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self._scheduler = Scheduler(
            n_slots=model.n_seq,
            n_ctx=model.n_ctx,
            n_batch=num_batch or model.n_batch,
            max_queue=max_queue,
            kv_pad=model.kv_pad,
            prefix_cache=self.prefix_cache,
            # Learnt from this engine's own steps (step_budget.py): a long prompt beside decoders goes in chunks that
            # keep their pace.
            pacing=pacing if pacing is not None else StepBudget(),
            kv_cells=model.kv_cells,
        )
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._outstanding = 0
        self._lock = threading.Lock()
        self._closed = False
        self._keeper = CacheKeeper(model, self.prefix_cache, self._scheduler)
        self._unopened: list[_Job] = []  # requests taken since the last schedule, told so after it (_open)
        self._embeds = EmbedQueue(model.n_ctx)  # served a batch per turn between steps (embed_queue.py)
        self.stats = EngineStats(slots_total=model.n_seq, threads=pinned_threads, kv_cells=model.kv_cells)
        self._publish_cache_figures()
        self._thread = threading.Thread(target=self._run, name="localllm-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------------- any thread

    @property
    def meta(self) -> ModelMeta:
        """The loaded weights' facts (vocabulary, special tokens, chat template)."""
        return self.model.meta

    @property
    def placement(self) -> Placement | None:
        """Where the layers went (`ps`); None where the backend does not place them."""
        return self.model.placement

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""
        return self.model.token_bytes(token)

    def token_text(self, token: int) -> str:
        """A token's own text, special tokens included (the BOS/EOS a chat template writes)."""
        return self.model.token_text(token)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if self._closed:
            raise Cancelled("the model was unloaded")
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def image_tokens(self, image: ImagePixels) -> list[int]:
        """The prompt piece for one image (tokenizing only: any thread may ask); see Vision.image_tokens."""
        if self._closed:
            raise Cancelled("the model was unloaded")
        return vision_of(self.model).image_tokens(image)

    def submit(self, params: GenerationParams) -> Stream:
        """Queue a generation; raises ContextOverflow or QueueFull at once, never later."""
        return self.submit_all([params])[0]

    def submit_all(self, batch: Sequence[GenerationParams]) -> list[Stream]:
        """Queue several generations that start in the same step (a client's batch of prompts): all of them or,
        with ContextOverflow or QueueFull raised at once, none. A batch larger than the slots and the queue together
        is InvalidInput: it could never start."""
        if self._closed:
            raise Cancelled("the model is being unloaded")
        if self.model.meta.embedding_only:
            raise InvalidInput(
                "this model does not support generate: it is an embedding model",
                hint="embed with /api/embed or /v1/embeddings; chat and generate need a language model",
            )
        if len(batch) > self.n_slots + self.max_queue:  # it could never be admitted: a 503 would repeat forever
            raise InvalidInput(
                f"a batch of {len(batch)} generations (n) is more than this model can ever hold: "
                f"{self.n_slots} slots and a queue of {self.max_queue}, {self.n_slots + self.max_queue} at once",
                hint=f"ask for at most {self.n_slots + self.max_queue}, or raise LOCALLLM_MAX_QUEUE / "
                "LOCALLLM_NUM_PARALLEL",
            )
        fitted = [self._fit_prompt(params) for params in batch]
        with self._lock:
            if self._outstanding + len(batch) > self.n_slots + self.max_queue:
                raise QueueFull(
                    f"all {self.n_slots} slots are busy and {self.max_queue} requests are waiting",
                    hint="retry shortly, or raise LOCALLLM_MAX_QUEUE / LOCALLLM_NUM_PARALLEL",
                )
            self._outstanding += len(batch)
        admitted = [self._new_request(params, prompt, truncated) for params, (prompt, truncated) in zip(batch, fitted)]
        _share_prefills([request for request, _ in admitted])
        self._inbox.put(_Submit(admitted))
        return [Stream(request, request.sink.outbox) for request, _ in admitted]

    def _new_request(
        self, params: GenerationParams, prompt: list[int], truncated: int
    ) -> tuple[_Job, GenerationParams]:
        opts = params.sampling
        max_tokens = opts.num_predict if opts.num_predict >= 0 else math.inf  # -1, -2: until the context is full
        if params.n_ctx is not None:  # a smaller context asked of a larger load ends where its own would
            max_tokens = min(max_tokens, max(0, params.n_ctx - len(prompt)))
        sink = _Output(
            queue.SimpleQueue(),
            TextStream(self.model.token_bytes, opts.stop),
            truncated=truncated,
            logprobs=params.logprobs,
        )
        if params.started is not None:
            sink.t_submit = params.started
        request = Request(prompt=prompt, max_tokens=max_tokens, sink=sink, keep_prefix=params.keep_prefix)
        request.images = params.images
        request.deterministic = opts.deterministic or self._all_deterministic
        return request, params

    def embed(
        self, inputs: Sequence[Sequence[int]], cancelled: Callable[[], bool] = lambda: False
    ) -> list[list[float]]:
        """The inputs' vectors, embedded a batch at a time between other work; raises Cancelled, its work
        dropped, once `cancelled()` turns true (the client left)."""
        future: Future[list[list[float]]] = Future()
        self._inbox.put(_Embed(EmbedJob(list(map(list, inputs)), future, cancelled)))
        return future.result()

    def pair_tokens(self, query: str, document: str) -> list[int]:
        """The sequence a reranker scores for one query/document pair (tokenizing only: any thread may ask)."""
        if self._closed:
            raise Cancelled("the model was unloaded")
        return reranker_of(self.model).pair_tokens(query, document)

    def rerank(self, pairs: Sequence[Sequence[int]]) -> list[float]:
        """The relevance score of each pair from pair_tokens, decoded on the engine thread between steps."""
        if self._closed:
            raise Cancelled("the model was unloaded")
        future: Future[list[float]] = Future()
        self._inbox.put(_Rerank(list(map(list, pairs)), future))
        return future.result()

    def export_prefix(self, tokens: Sequence[int]) -> bytes:
        """The saved state of the longest cached prefix of `tokens` (a slot's or the prefix cache's), as a
        prompt-cache file's bytes; InvalidInput when nothing of them is cached."""
        future: Future[bytes] = Future()
        self._inbox.put(_Export(list(tokens), future))
        return future.result()

    def import_prefix(self, blob: bytes) -> int:
        """Put a state from export_prefix into the prefix cache, pinned; the number of tokens it holds."""
        future: Future[int] = Future()
        self._inbox.put(_Import(blob, future))
        return future.result()

    @property
    def closed(self) -> bool:
        return self._closed

    def busy(self) -> bool:
        return self._outstanding > 0

    def machine_changed(self) -> None:
        """Work of ours that shared the CPU has ended (the load check's background trial): the tuned thread counts
        are tried again before the next step, as one settled while it ran may be the wrong one."""
        self._machine_changed.set()

    def close(self) -> None:
        """Stop the thread; unfinished requests end with Cancelled. Frees the native context."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_Close())
        self._thread.join()

    def _fit_prompt(self, params: GenerationParams) -> tuple[list[int], int]:
        prompt, n_ctx = list(params.prompt), min(self.n_ctx, params.n_ctx or self.n_ctx)
        if not prompt:
            raise InvalidInput(
                "the prompt is empty after templating", hint="the template rendered nothing: check it, or send a prompt"
            )
        if params.images:
            _check_image_runs(prompt, self.model.n_batch)
        if len(prompt) < n_ctx:
            return prompt, 0
        if not params.truncate or params.images:  # a cut could fall inside an image
            raise ContextOverflow(prompt_tokens=len(prompt), num_ctx=n_ctx)
        # Keep the newest tokens (and a leading BOS), leaving a quarter of the context for the answer.
        keep = max(1, n_ctx - max(1, n_ctx // 4))
        head = prompt[:1] if prompt[0] == self.model.meta.bos_token else []
        tail = prompt[len(prompt) - (keep - len(head)) :]
        return head + tail, len(prompt) - len(head) - len(tail)

    # ----------------------------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        lost = False
        try:
            while self._serve_inbox(block=self._scheduler.idle and not self._embeds):
                if self._embeds:
                    self._embeds.turn(self._embed)
                self._propose_drafts()
                step = self._scheduler.schedule()
                if self.threads is not None and step.batch.tokens:
                    # Before _open's news wakes the server's threads; not for a step of copies alone (a restore's),
                    # whose single thread leaves a burst elsewhere time to end before the decode after it reads.
                    self.threads.resume()
                self._open()
                self._report(step.finished)
                if step.batch.tokens or step.cache_ops:
                    self._run_step(step)
        except WorkerLost as exc:
            lost = True
            log.error("engine stopped: %s", exc)
            self._fail_all(exc)
        except BaseException as exc:  # the thread must never die silently: fail everything in flight
            log.exception("engine thread failed")
            self._fail_all(exc if isinstance(exc, LocalLLMError) else LocalLLMError(f"engine failed: {exc}"))
        finally:
            self._closed = True  # new requests get Cancelled, not a queue nobody reads (the pool then reloads)
            self._fail_all(Cancelled("the model was unloaded"))
            if not lost:  # a lost worker's cache would be read through its dead connection, which never returns
                self._keeper.keep_on_disk()
            if self.speculation is not None:
                self.speculation.close()
            self.model.close()

    def _serve_inbox(self, *, block: bool) -> bool:
        """Take every pending command; block for one when there is nothing to do. False means close."""
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            match cmd:
                case _Close():
                    return False
                case _Submit(admitted):
                    for request, params in admitted:
                        self._admit(request, params)
                case _Embed(job):
                    self._embeds.add(job)
                case _Rerank(pairs, future):
                    self._answer(future, self._rerank, pairs)
                case _Export(tokens, future):
                    self._answer(future, self._keeper.export, tokens)
                case _Import(blob, future):
                    self._answer(future, self._import, blob)

    def _admit(self, request: _Job, params: GenerationParams) -> None:
        try:
            sampler = request.sampler = self.model.make_sampler(
                params.sampling, grammar=params.grammar, triggers=params.grammar_triggers
            )
            for tok in request.prompt:
                if not is_placeholder(tok):  # an image's embeddings are no token penalties could count
                    sampler.accept(tok)
            # Drafters read prompts as tokens: a prompt with images is not speculated on. Verify batches change
            # numerics, so a deterministic request is not either.
            if self.speculation is not None and not request.deterministic and not request.images:
                request.drafter = self.speculation.drafter_for(
                    # a lazy grammar's probe would hold drafts to it from the first token: drafts go unprobed
                    params.sampling,
                    grammar=None if params.grammar_triggers is not None else params.grammar,
                    n_prompt=len(request.prompt),
                )
            self._scheduler.admit(request)
            self._unopened.append(request)
        except LocalLLMError as exc:
            self._close_request(request, exc)
        except Exception as exc:  # a bug in building this request's sampler or drafter fails it, not the engine
            log.exception("could not start a request")
            self._close_request(request, LocalLLMError(f"could not start the request: {exc}"))

    def _open(self) -> None:
        """Tell each request taken since the last schedule that it is in: with its slot's cached tokens when the
        schedule gave it one, without them when it waits for one."""
        for request in self._unopened:
            if not request.finished:
                cached = request.n_cached if request.slot is not None else None
                request.sink.outbox.put(Opening(len(request.prompt), cached))
        self._unopened.clear()

    def _embed(self, inputs: list[list[int]]) -> list[list[float]]:
        return embedder_of(self.model).embed(inputs)

    def _rerank(self, pairs: list[list[int]]) -> list[float]:
        return reranker_of(self.model).rerank(pairs)

    @staticmethod
    def _answer(future: Future, work, *args) -> None:
        try:
            future.set_result(work(*args))
        except BaseException as exc:
            future.set_exception(exc)

    def _import(self, blob: bytes) -> int:
        tokens = self._keeper.import_(blob)
        self._publish_cache_figures()
        return tokens

    def _encode_images(self, step: Step) -> None:
        """Encode the images whose placeholders this step decodes (the backend keeps recent ones at hand)."""
        wanted = {t for t in step.batch.tokens if is_placeholder(t)}
        if not wanted:
            return
        vision = vision_of(self.model)
        for req in self._scheduler.in_batch(step):
            for image in req.images:
                if wanted.intersection(image.placeholders):
                    vision.encode_image(image)

    def _propose_drafts(self) -> None:
        """Ask each generating request's drafter for this step's draft tokens (speculative decoding)."""
        decoding = self._scheduler.decoding()
        for req in decoding:
            req.draft = []
        speculating = [req for req in decoding if req.drafter is not None]
        if not speculating:
            return
        busy = len(self._scheduler.running)
        # When the batch makes rows too dear for even a certain draft, no drafter is asked: a step that cannot
        # speculate costs what it would with speculation off (only a request's spec_min_draft overrides that).
        depth = max(len(req.prompt) + len(req.generated) for req in decoding)
        gate = self.speculation is None or self.speculation.may_draft(busy, depth)
        for req in speculating:
            room = self._scheduler.draft_room(req)
            if room == 0 or req.drafter is None or req.slot is None or not (gate or req.drafter.insists):
                continue
            t0 = time.perf_counter()
            try:
                req.draft = req.drafter.propose(
                    req.prompt + req.generated, seq=req.slot.seq, busy_slots=busy, room=room
                )
            except LocalLLMError as exc:  # speculation only saves time: the request goes on without it
                log.warning("speculation off for request %d: %s", req.id, exc)
                req.drafter.close()
                req.drafter, req.draft = None, []
            finally:
                req.sink.draft_seconds += time.perf_counter() - t0

    def _run_step(self, step: Step) -> None:
        self._apply_cache_ops(step)
        if not step.batch.tokens:
            return
        kind: StepKind = "decode" if all(step.batch.logits) else "batch"
        threads = self._set_threads(kind)
        t0, clock0 = time.perf_counter(), self.model.step_clock()
        try:
            self._encode_images(step)
            self.model.decode(step.batch)
        except WorkerLost:
            raise  # the model is abandoned: the engine ends, and the pool loads it again for the next request
        except LocalLLMError as exc:
            if not self._rewind_restores(step):
                self._fail_step(step, exc)
            return
        self._confirm_restores(step)
        seconds = time.perf_counter() - t0
        if self.threads is not None:
            # Wall time, not CPU time: a thread that waits for a core another process holds is what it must see.
            self.threads.record(kind, threads, len(step.batch), seconds)
        if self._scheduler.pacing is not None:
            self._scheduler.pacing.observe(len(step.batch), seconds, chunk=kind == "batch")
        if kind == "batch" and self.prefix_cache is not None:
            self.prefix_cache.price.observe_prefill(len(step.batch), seconds)
        if self.speculation is not None:
            self.speculation.observe(step.batch, step.copies)
        decoded = time.perf_counter()
        sampled = self._sample(step)
        self.stats.decode_seconds += time.perf_counter() - t0
        for work in step.work:
            if work.draft:
                work.request.sink.verify_seconds += decoded - t0
        if self.speculation is not None:
            # On the model's step clock (its CPU time where that follows the work): what drafts are priced against.
            self.speculation.record_step(
                step.batch,
                self.model.step_clock() - clock0,
                busy=len(sampled),
                emitted=sum(len(tokens) for tokens in sampled.values()),
                drafted=any(work.draft for work in step.work),
            )
        self._scheduler.update(step, sampled)
        self._drop_rejected(step)
        self._emit(step, sampled)

    def _fail_step(self, step: Step, exc: LocalLLMError) -> None:
        """End every request with rows in a failed step (a prefill chunk has no work to sample: an image's rows),
        its slot's cache cut back to what was decoded before the step."""
        failed = list(self._scheduler.in_batch(step))
        for seq, keep in self._scheduler.rewind(step, restart=[]):
            self.model.remove(seq, keep)
        for req in failed:
            self._scheduler.finish(req, "error")
            self._close_request(req, exc)

    def _rewind_restores(self, step: Step) -> bool:
        """A decode that fails on the rows right after a restore blames that saved state: it is dropped (RAM and
        disk), its request prefills from the start and the step runs again; False when no restore is to blame."""
        blamed = [req for req in self._scheduler.in_batch(step) if req.unconfirmed is not None]
        if not blamed:
            return False
        for req in blamed:
            assert req.unconfirmed is not None
            self._keeper.discard(req.unconfirmed)
            req.unconfirmed = None
        for seq, keep in self._scheduler.rewind(step, restart=blamed):
            self.model.remove(seq, keep)
        self._publish_cache_figures()
        return True

    def _confirm_restores(self, step: Step) -> None:
        for req in self._scheduler.in_batch(step):
            if req.unconfirmed is not None:
                self._keeper.confirm(req.unconfirmed)
                req.unconfirmed = None

    def _set_threads(self, kind: StepKind) -> int:
        if self.threads is None:
            return 0
        if self._machine_changed.is_set():
            self._machine_changed.clear()
            self.threads.retry()
        threads = self.threads.choose(kind)
        control = self.model.threads
        if threads != self._threads_now and control is not None:
            control.set(threads)
            self._threads_now = threads
        if kind == "decode":
            self.stats.threads = threads
        return threads

    def _apply_cache_ops(self, step: Step) -> None:
        if self._keeper.apply(step):
            self._publish_cache_figures()
        for seq, keep in step.trims:
            self.model.remove(seq, keep)
        for src, dst, n in step.copies:
            self.model.copy_prefix(src, dst, n)

    def _publish_cache_figures(self) -> None:
        """Copy the cache's sizes into the stats other threads read (ps, /metrics)."""
        if self.prefix_cache is None:
            return
        figures = self.prefix_cache.figures()
        s = self.stats
        s.cache_ram_bytes, s.cache_ram_limit = figures.ram.bytes_held, figures.ram.limit
        s.cache_disk_bytes, s.cache_disk_limit = figures.disk.bytes_held, figures.disk.limit

    def _sample(self, step: Step) -> dict[int, list[int]]:
        sampled: dict[int, list[int]] = {}
        for work in step.work:
            req = work.request
            if req.finished:
                continue
            t0 = time.perf_counter()
            tokens = self._verify(req.sampler, work.rows, work.draft)
            if work.draft:
                req.sink.sample_seconds += time.perf_counter() - t0
                self._count_draft(req, len(work.draft), min(len(tokens) - 1, len(work.draft)))
            if req.sink.logprobs is not None:
                req.sink.pending_logprobs.extend(self._logprobs(work.rows, tokens, req.sink.logprobs))
            sampled[req.id] = tokens
        return sampled

    def _count_draft(self, req: _Job, drafted: int, accepted: int) -> None:
        req.n_drafted += drafted
        req.n_accepted += accepted
        req.n_draft_steps += 1
        last = ACCEPTANCE_POSITIONS - 1
        verified, hits = self.stats.verified_at, self.stats.accepted_at
        for position in range(min(drafted, accepted + 1)):  # past the first miss nothing was really tried
            verified[min(position, last)] += 1
            hits[min(position, last)] += position < accepted
        if req.drafter is not None:
            req.drafter.feedback(drafted=drafted, accepted=accepted)

    @staticmethod
    def _verify(sampler, rows: list[int], draft: list[int]) -> list[int]:
        # Lossless speculative acceptance: sample the target at every position with the request's own chain and keep
        # draft token i only while it equals what the target sampled there; the first disagreement is replaced by
        # the target's token (so each step yields 1..len(draft)+1 tokens, exactly the non-speculative sequence).
        tokens: list[int] = []
        for i, row in enumerate(rows):
            tok = sampler.sample(row)
            tokens.append(tok)
            if i >= len(draft) or tok != draft[i]:
                break
        return tokens

    def _logprobs(self, rows: list[int], tokens: list[int], top_n: int) -> list[TokenLogprob]:
        out = []
        for row, tok in zip(rows, tokens):
            logits = self.model.logits(row).astype(np.float64)
            logz = float(np.logaddexp.reduce(logits))
            top = _top_indices(logits, top_n)
            out.append(
                TokenLogprob(tok, float(logits[tok]) - logz, tuple((int(t), float(logits[t]) - logz) for t in top))
            )
        return out

    def _drop_rejected(self, step: Step) -> None:
        """Remove rejected draft tokens from the slot's KV: update() kept only the verified ones in `cached`."""
        for work in step.work:
            req = work.request
            if work.draft and req.slot is not None and req.slot.request is req:
                self.model.remove(req.slot.seq, len(req.slot.cached))

    def _emit(self, step: Step, sampled: dict[int, list[int]]) -> None:
        now = time.perf_counter()
        first = False
        for work in step.work:
            req = work.request
            tokens = sampled.get(req.id)
            if not tokens or req.finished:
                continue
            out: _Output = req.sink
            if not out.t_first:
                out.t_first, first = now, True
            self._emit_tokens(req, tokens)
        if first and self.threads is not None:
            self.threads.hand_over()

    def _emit_tokens(self, req: Request, tokens: list[int]) -> None:
        out: _Output = req.sink
        text: list[str] = []
        shown: list[int] = []
        reason = None
        for tok in tokens:
            if len(req.generated) - len(tokens) + len(shown) >= req.max_tokens:  # num_predict 0: the prompt only
                reason = "length"
                break
            if self.model.is_eog(tok):
                reason = "stop"
                break
            shown.append(tok)
            text.append(out.text.feed(tok))
            if out.text.stopped:
                reason = "stop"
                break
            if len(req.generated) - len(tokens) + len(shown) >= req.max_tokens:
                reason = "length"
                break
        if reason is None and self._scheduler.context_left(req) <= 1:
            reason = "length"
        if reason is not None:
            # Tokens past the end (after EOS, a stop string or the limit) are not part of the answer.
            del req.generated[len(req.generated) - len(tokens) + len(shown) :]
        if text or shown:
            logprobs = tuple(out.pending_logprobs[: len(shown)])
            out.pending_logprobs.clear()
            out.outbox.put(EngineChunk(text="".join(text), tokens=tuple(shown), logprobs=logprobs, cached=req.n_cached))
        if reason is not None:
            self._scheduler.finish(req, reason)
            self._report([req])

    def _report(self, finished: list[Request]) -> None:
        for req in finished:
            out: _Output = req.sink
            tail = out.text.flush() if req.done_reason != "cancelled" else ""
            self._count(req)
            out.outbox.put(EngineChunk(text=tail, done=True, done_reason=req.done_reason, timings=self._timings(req)))
            self._release(req)

    def _count(self, req: Request) -> None:
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(req.prompt)
        s.cached_tokens += req.n_cached
        s.generated_tokens += len(req.generated)
        s.draft_tokens += req.n_drafted
        s.accepted_tokens += req.n_accepted
        s.draft_steps += req.n_draft_steps
        if req.cache_tier is not None and req.n_cached:
            s.prefix_hits[req.cache_tier] += 1
            s.prefix_tokens[req.cache_tier] += req.n_cached

    def _timings(self, req: Request) -> Timings:
        out: _Output = req.sink
        end = time.perf_counter()
        first = out.t_first or end
        # The prefill is everything from admission to the first sampled token: the wait for a slot and every prefill
        # chunk (a slot's work shows in a step only with its last chunk), so the parts add up to the total.
        start = out.t_submit

        def ns(seconds: float) -> int:
            return max(0, int(seconds * 1e9))

        return Timings(
            total_duration=ns(end - out.t_submit),
            prompt_eval_count=len(req.prompt),
            prompt_eval_duration=ns(first - start),
            eval_count=len(req.generated),
            eval_duration=ns(end - first),
            prompt_cache_count=req.n_cached,
            truncated_tokens=out.truncated,
            draft_count=req.n_drafted,
            draft_accepted=req.n_accepted,
            draft_mean_accepted=round(req.n_accepted / req.n_draft_steps, 3) if req.n_draft_steps else 0.0,
            draft_duration=ns(out.draft_seconds),
            verify_duration=ns(out.verify_seconds),
            sample_duration=ns(out.sample_seconds),
        )

    def _close_request(self, req: Request, exc: BaseException) -> None:
        req.done_reason = req.done_reason or "error"  # over: a request that follows it stops waiting for it
        req.sink.outbox.put(exc)
        self._release(req)

    def _release(self, req: Request) -> None:
        if req.drafter is not None:
            req.drafter.close()
            req.drafter = None
        if req.sampler is not None:
            req.sampler.close()
            req.sampler = None
        with self._lock:
            self._outstanding -= 1

    def _fail_all(self, exc: LocalLLMError) -> None:
        pending = list(self._scheduler.waiting) + self._scheduler.running
        self._scheduler.waiting.clear()
        self._embeds.fail_all(exc)
        for req in pending:
            self._scheduler.finish(req, "error")
            self._close_request(req, exc)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            match cmd:
                case _Submit(admitted):
                    for request, _ in admitted:
                        self._close_request(request, exc)
                case _Embed(job):
                    job.future.set_exception(exc)
                case _Rerank(_, future) | _Export(_, future) | _Import(_, future):
                    future.set_exception(exc)

    def snapshot(self) -> EngineStats:
        s = self.stats
        s.slots_busy = len(self._scheduler.table.busy())
        s.queue_depth = len(self._scheduler.waiting)
        s.kv_used = min(self._scheduler.cells_held(), s.kv_cells)
        s.embedded_inputs, s.embeds_dropped = self._embeds.embedded, self._embeds.dropped
        return s


def _check_image_runs(prompt: list[int], n_batch: int) -> None:
    """Refuse a prompt the scheduler could not prefill: an image is prefilled whole, in one batch, and the prompt's
    last token must be text (its output is the first answer token)."""
    if is_placeholder(prompt[-1]):
        raise InvalidInput("the prompt ends with an image", hint="add text after the image")
    run = longest = 0
    for token in prompt:
        run = run + 1 if is_placeholder(token) else 0
        longest = max(longest, run)
    if longest > n_batch:
        raise InvalidInput(
            f"an image takes {longest} positions, more than num_batch {n_batch}",
            hint=f"raise num_batch to at least {longest}, or send a smaller image",
        )
