"""llama.cpp through llama-cpp-python's low-level API: one llama_context per loaded model with one sequence per slot.

The sequences draw their KV cells from one pool (llama.cpp's unified cache, as llama-server's default): `kv_cells`
(models/plan.kv_cells, at least `n_ctx`), each sequence able to hold up to `n_ctx` of them, so one long conversation
uses what short ones leave; the scheduler keeps the sum within the pool. A pool as large as every slot's context
takes a separate KV stream per sequence instead (kv_unified off): nothing to share. Sampling runs in llama.cpp's C
sampler chain; Python only picks which output row each chain reads. Plain greedy requests (temperature 0, nothing but
logit biases) take a shortcut that picks the same token without copying the vocabulary (GreedySampler).

Weights are shared: every load over the same files with the same weight-affecting options (GPU layers, mmap) gets the
same llama_model, counted in `_WEIGHTS`, and its own context. LoRA adapters belong to a context: each load applies
its own (llama_adapter_lora_init on the shared model, llama_set_adapters_lora on its context)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import llama_cpp
import numpy as np

from ...api import GrammarTriggers, LoadOptions, LoraAdapter, SamplingOptions
from ...chat.call_formats import word_pattern
from ...chat.fim import FimTokens
from ...errors import InvalidInput, LocalLLMError, ModelFormatError, WorkerLost
from ...machine import physical_cores
from ...media import is_placeholder
from ...models.options import context_size
from ...models.plan import Placement, kv_cells
from ..base import Batch, CacheShape, ModelMeta
from .embedding import MAX_SEQS, LlamaEmbedder, pooling_for
from .rerank import LlamaReranker, pair_layout
from .rpc import PlacedModel, RpcGuard, place_model
from .speculative import LlamaGrammarChecks, LlamaMtpLayers
from .states import LlamaSequenceStates
from .vision import Projector, decode_rows

log = logging.getLogger(__name__)

_KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
_init_lock = threading.Lock()
_initialised = False


def init_backend() -> None:
    """llama_backend_init once per process, and route llama.cpp's chatter through Python logging."""
    global _initialised
    with _init_lock:
        if _initialised:
            return
        from llama_cpp import _logger

        _logger.set_verbose(logging.getLogger("localllm").isEnabledFor(logging.DEBUG))
        llama_cpp.llama_backend_init()
        _initialised = True


WeightsKey = tuple[str, int, tuple[float, ...], bool]


def weights_key(path: Path, options: LoadOptions, placed: PlacedModel) -> WeightsKey:
    """What makes two loads' llama_models interchangeable: the same file (a split GGUF's first part names the set),
    placed alike, with the options that shape the weights in memory. Context options (num_ctx, slots, KV type, ...)
    do not count."""
    placement = placed.placement
    return str(Path(path).absolute()), placement.n_gpu_layers, tuple(placement.tensor_split), options.use_mmap


class _SharedWeights:
    """Loaded llama_models by WeightsKey, with how many contexts use each; freed when the last one closes.

    The lock also covers context creation and adapter changes: llama.cpp sizes a new context's graph from the
    model's list of adapters, which llama_adapter_lora_init / _free change."""

    def __init__(self):
        self.lock = threading.RLock()
        self._models: dict[WeightsKey, list] = {}  # key -> [llama_model pointer, users]

    def acquire(self, path: Path, options: LoadOptions, placed: PlacedModel):
        key = weights_key(path, options, placed)
        with self.lock:
            entry = self._models.get(key)
            if entry is None:
                entry = self._models[key] = [_load_weights(path, options, placed), 0]
            entry[1] += 1
            return key, entry[0]

    def release(self, key: WeightsKey) -> None:
        with self.lock:
            entry = self._models[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._models[key]
                llama_cpp.llama_model_free(entry[0])

    def users(self, key: WeightsKey) -> int:
        with self.lock:
            entry = self._models.get(key)
            return entry[1] if entry else 0


_WEIGHTS = _SharedWeights()


def loaded_weights_users(key: WeightsKey) -> int:
    """How many loaded contexts share the llama_model of `key` (0: not loaded)."""
    return _WEIGHTS.users(key)


class LlamaCppBackend:
    name = "llama.cpp"

    def load(
        self,
        path: Path,
        options: LoadOptions,
        *,
        adapters: Sequence[LoraAdapter] = (),
        projector: Path | None = None,
    ) -> LlamaCppModel:
        n_seq, n_ctx = context_size(options)
        init_backend()
        if not Path(path).is_file():
            raise ModelFormatError(f"weights file {path} does not exist")
        placed = place_model(path, options, n_seq=n_seq, n_ctx=n_ctx)
        if placed.endpoints:
            if projector is not None:
                raise InvalidInput(
                    "a model with a vision projector cannot load over RPC workers yet", hint="unset LOCALLLM_RPC"
                )
            return _load_over_rpc(path, options, placed, n_seq=n_seq, n_ctx=n_ctx, adapters=adapters)
        key, model = _WEIGHTS.acquire(path, options, placed)
        ctx, loras, vision = None, _Adapters([], []), None
        try:
            ctx = _new_context(model, options, n_seq=n_seq, n_ctx=n_ctx)
            loras = _apply_adapters(model, ctx, adapters)
            if projector is not None:
                vision = _load_projector(projector, model, options)
            return LlamaCppModel(
                path,
                model,
                ctx,
                options,
                n_seq=n_seq,
                n_ctx=n_ctx,
                placement=placed.placement,
                release_weights=partial(_WEIGHTS.release, key),
                weights=key,
                adapters=loras,
                projector=vision,
            )
        except BaseException:
            if vision is not None:
                vision.close()
            _free_adapters(loras)
            if ctx is not None:
                llama_cpp.llama_free(ctx)
            _WEIGHTS.release(key)
            raise

    def placement(self, path: Path, options: LoadOptions) -> Placement:
        n_seq, n_ctx = context_size(options)
        return place_model(path, options, n_seq=n_seq, n_ctx=n_ctx).placement


def _load_projector(path: Path, model, options: LoadOptions) -> Projector | None:
    """The model's vision projector, or None where mtmd cannot use it: the model still chats in text (a projector
    pulled from an Ollama registry may be one only Ollama's own engine reads), and images are refused."""
    threads = options.num_thread or physical_cores()
    try:
        return Projector(path, model, n_threads=threads, n_embd=llama_cpp.llama_model_n_embd(model))
    except ModelFormatError as exc:
        log.warning("%s: images are off for this load: %s", path.name, exc.message)
        return None


def _load_over_rpc(
    path: Path, options: LoadOptions, placed: PlacedModel, *, n_seq: int, n_ctx: int, adapters: Sequence[LoraAdapter]
) -> LlamaCppModel:
    """A load with layers on RPC workers: its own weights (never shared), and every native call that may reach a
    worker through the guard, which gives up when a worker is lost."""
    from ... import config

    guard = RpcGuard(placed.endpoints)
    # Loading sends the worker its layers: the deadline allows for a slow link (about 10 MB/s) on top of a call's.
    load_seconds = config.RPC_TIMEOUT.get() + Path(path).stat().st_size / 10e6
    try:
        model = guard.call_within(load_seconds, _load_weights, path, options, placed)
        try:
            ctx = guard.call(_new_context, model, options, n_seq=n_seq, n_ctx=n_ctx)
            loras = guard.call(_apply_adapters, model, ctx, adapters)
        except WorkerLost:
            raise
        except BaseException:
            guard.call(llama_cpp.llama_model_free, model)
            raise
    except BaseException:
        guard.close()
        raise
    return LlamaCppModel(
        path,
        model,
        ctx,
        options,
        n_seq=n_seq,
        n_ctx=n_ctx,
        placement=placed.placement,
        release_weights=partial(llama_cpp.llama_model_free, model),
        weights=(str(path), id(model)),
        adapters=loras,
        guard=guard,
    )


class _Adapters:
    """The LoRA adapters of one context: native handles and scales, set on each context of the load."""

    def __init__(self, handles: list, scales: list[float]):
        self.handles = handles
        self.scales = scales

    def set_on(self, ctx) -> None:
        if not self.handles:
            return
        array = (llama_cpp.llama_adapter_lora_p_ctypes * len(self.handles))(*self.handles)
        scales = (ctypes.c_float * len(self.scales))(*self.scales)
        with _WEIGHTS.lock:
            if llama_cpp.llama_set_adapters_lora(ctx, array, len(self.handles), scales) != 0:
                raise LocalLLMError("llama.cpp could not set the LoRA adapters on the context")
            _reserve_now(ctx)


def _apply_adapters(model, ctx, adapters: Sequence[LoraAdapter]) -> _Adapters:
    handles: list = []
    try:
        for adapter in adapters:
            with _WEIGHTS.lock:
                handle = llama_cpp.llama_adapter_lora_init(model, str(adapter.path).encode())
            if not handle:
                raise ModelFormatError(
                    f"llama.cpp could not apply the LoRA adapter {adapter.path}",
                    hint="the adapter must be trained for this base model (same architecture and tensor shapes)",
                )
            handles.append(handle)
        result = _Adapters(handles, [float(a.scale) for a in adapters])
        result.set_on(ctx)
        return result
    except BaseException:
        _free_adapters(_Adapters(handles, []))
        raise


def _free_adapters(adapters: _Adapters) -> None:
    with _WEIGHTS.lock:
        for handle in adapters.handles:
            llama_cpp.llama_adapter_lora_free(handle)
        adapters.handles = []


def _reserve_now(ctx) -> None:
    """Decode one token and forget it: llama.cpp re-plans a context's graph (reading the shared model's adapter
    list) at the first decode after its adapters change; doing it here keeps that under the weights lock."""
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    try:
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = 0, 0, 1, True
        batch.seq_id[0][0] = 0
        llama_cpp.llama_decode(ctx, batch)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    finally:
        llama_cpp.llama_batch_free(batch)


def _load_weights(path: Path, options: LoadOptions, placed: PlacedModel):
    params = llama_cpp.llama_model_default_params()
    # Always an explicit device list (NULL-terminated), even empty: a NULL list would take every device ggml
    # knows, RPC workers another load registered included.
    devices = (ctypes.c_void_p * (len(placed.devices) + 1))(*[d.handle for d in placed.devices], None)
    split = (ctypes.c_float * max(llama_cpp.llama_max_devices(), len(devices)))(*placed.placement.tensor_split)
    params.devices = ctypes.cast(devices, ctypes.c_void_p)
    params.tensor_split = split
    params.n_gpu_layers = placed.placement.n_gpu_layers
    params.use_mmap = options.use_mmap
    # Weights with MTP (nextn) layers bring their heads for speculative decoding (speculative.py); the trunk's own
    # context never runs them, and files without them are unaffected.
    params.load_mtp = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelFormatError(
            f"llama.cpp could not load {path}",
            hint="the file is not a GGUF model this llama.cpp supports; `localllm verify` checks it",
        )
    return model


def _context_params(options: LoadOptions, *, n_seq: int, n_ctx: int, pooling: int | None = None):
    params = llama_cpp.llama_context_default_params()
    # Unpinned, the engine's thread tuner sets each step's count; it starts from every physical core.
    threads = options.num_thread or physical_cores()
    cells = kv_cells(n_ctx, n_seq)
    params.n_ctx = cells
    params.n_batch = max(options.num_batch, n_seq)
    params.n_ubatch = params.n_batch
    params.n_seq_max = n_seq
    params.n_threads = threads
    params.n_threads_batch = threads
    params.kv_unified = cells < n_ctx * n_seq
    # Sliding-window layers get full-size caches that keep every position, so a slot cut anywhere stays exact; only a
    # saved state drops the masked cells (CacheShape.saved_floor).
    params.swa_full = True
    params.no_perf = True
    # LOCALLLM_KV_CACHE_TYPE and LOCALLLM_FLASH_ATTENTION were applied by models/options.effective_load; unset here
    # is llama.cpp's own default.
    kv = _KV_TYPES[options.kv_type or "f16"]
    params.type_k = kv
    params.type_v = kv
    flash = options.flash_attn
    # A quantized V cache needs flash attention in llama.cpp; turn it on rather than fail. Unset: llama.cpp decides.
    if flash or kv != llama_cpp.GGML_TYPE_F16:
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    elif flash is False:
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    else:
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    if pooling is not None:
        # Embeddings mode: the sequences of one decode share one pool of n_ctx cells (embedding.pack fills it).
        params.embeddings = True
        params.pooling_type = pooling
        params.n_ctx = n_ctx
        params.kv_unified = True
    return params


def _new_context(model, options: LoadOptions, *, n_seq: int, n_ctx: int, pooling: int | None = None):
    params = _context_params(options, n_seq=n_seq, n_ctx=n_ctx, pooling=pooling)
    with _WEIGHTS.lock:  # sized from the shared model's adapter list (see _SharedWeights)
        ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        # Almost always memory (models/options.check_memory catches most cases before this): the request's fault.
        raise InvalidInput(
            f"llama.cpp could not create a context of {n_seq} x {n_ctx} tokens",
            hint="lower num_ctx or num_parallel; `localllm plan` shows the memory needed",
        )
    return ctx


def _meta_str(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else None


def _read_meta(model, path: Path) -> ModelMeta:
    vocab = llama_cpp.llama_model_get_vocab(model)
    template = llama_cpp.llama_model_chat_template(model, None)
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, desc, len(desc))

    def token_or_none(tok: int) -> int | None:
        return tok if tok >= 0 else None

    return ModelMeta(
        architecture=_meta_str(model, "general.architecture") or "unknown",
        n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
        n_ctx_train=llama_cpp.llama_model_n_ctx_train(model),
        n_embd=llama_cpp.llama_model_n_embd(model),
        bos_token=token_or_none(llama_cpp.llama_vocab_bos(vocab)),
        eos_token=token_or_none(llama_cpp.llama_vocab_eos(vocab)),
        add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        chat_template=template.decode("utf-8") if template else None,
        n_params=llama_cpp.llama_model_n_params(model),
        size_bytes=llama_cpp.llama_model_size(model),
        has_mtp=llama_cpp.llama_model_n_layer_nextn(model) > 0,
        description=desc.value.decode("utf-8", "replace"),
        fim=_fim_tokens(vocab),
        pooling=_pooling_type(model),
    )


def _fim_tokens(vocab) -> FimTokens | None:
    """llama.cpp's FIM tokens (from metadata, or recognised by their text); None unless prefix, suffix and middle
    are all there."""

    def token(tok: int) -> int | None:
        return tok if tok >= 0 else None

    pre, suf, mid = (
        token(f(vocab))
        for f in (llama_cpp.llama_vocab_fim_pre, llama_cpp.llama_vocab_fim_suf, llama_cpp.llama_vocab_fim_mid)
    )
    if pre is None or suf is None or mid is None:
        return None
    return FimTokens(
        pre, suf, mid, rep=token(llama_cpp.llama_vocab_fim_rep(vocab)), sep=token(llama_cpp.llama_vocab_fim_sep(vocab))
    )


def _pooling_type(model) -> int | None:
    """`<arch>.pooling_type` from the GGUF: set only in embedding models (nomic-bert, BERT, ...)."""
    arch = _meta_str(model, "general.architecture")
    value = _meta_str(model, f"{arch}.pooling_type") if arch else None
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


class LlamaThreads:
    """The ThreadControl part of every llama.cpp load: the context's thread counts for the next decodes."""

    def __init__(self, ctx):
        self._ctx = ctx

    def set(self, n: int) -> None:
        llama_cpp.llama_set_n_threads(self._ctx, n, n)


class LlamaCppModel:
    """A loaded GGUF: weights, one context of `n_seq` sequences, and a reusable batch buffer. Its parts: states,
    grammar checks and thread control always; vision with a projector; an embedder, or a reranker for a
    cross-encoder; MTP layers where the weights carry them."""

    # llama.cpp attends over a sequence's KV cells up to its highest used cell rounded up to 256 (llama_kv_cache::
    # get_n_kv, so that graphs can be reused); the scheduler ends prefill chunks on that grid.
    kv_pad = 256

    def __init__(
        self,
        path: Path,
        model,
        ctx,
        options: LoadOptions,
        *,
        n_seq: int,
        n_ctx: int,
        weights: Hashable,
        release_weights: Callable[[], None],
        adapters: _Adapters,
        placement: Placement | None = None,
        guard: RpcGuard | None = None,
        projector: Projector | None = None,
    ):
        self.path = path
        self.options = options
        self.weights = weights  # equal for every load that shares this llama_model (_WEIGHTS)
        self._release_weights = release_weights
        self._adapters = adapters
        self.placement = placement
        # With RPC workers, calls that reach them run through the guard, which gives up when a worker is lost.
        self._guard = guard
        self._model = model
        self._ctx = ctx
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._mem = llama_cpp.llama_get_memory(ctx)
        self.meta = replace(_read_meta(model, path), vision=projector is not None)
        self.vision = projector
        self._embd_batch = None  # a batch of embedding rows, made at the first image
        self.n_seq = n_seq
        # A unified pool lets any sequence reach all its cells; a slot's context stays the one asked for.
        self.n_ctx = min(n_ctx, llama_cpp.llama_n_ctx_seq(ctx))
        unified = kv_cells(n_ctx, n_seq) < n_ctx * n_seq
        self.kv_cells = min(llama_cpp.llama_n_ctx(ctx), n_seq * self.n_ctx) if unified else n_seq * self.n_ctx
        self.n_batch = llama_cpp.llama_n_batch(ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._embed_ctx = None  # the pooled context of an embedding model or a reranker (one or the other)
        self._piece_cache: dict[int, bytes] = {}
        self._eog: list[int] | None = None
        self._logits_row = ctypes.c_float * self.meta.n_vocab
        # A set, not a call per generated token: each ctypes call gives up the GIL, which the server's threads want.
        self._eog_set = frozenset(self.eog_tokens())
        self.states = LlamaSequenceStates(ctx, self._mem)
        self.grammars = LlamaGrammarChecks(model)
        self.threads = LlamaThreads(ctx)
        self.mtp = self._mtp_layers() if self.meta.has_mtp else None
        self.embedder = None if self.meta.reranker else self._embedder()
        self.reranker = self._reranker() if self.meta.reranker else None

    # ----------------------------------------------------------------------------------------------- text

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # llama.cpp returns minus the size it needs
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._piece_cache.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[:n]
            self._piece_cache[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        """The token's own text, special tokens included (for templates that write BOS/EOS themselves)."""
        text = llama_cpp.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", "replace") if text else ""

    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token (EOS, EOT, ...), found once: ignore_eos bans them all, as llama.cpp does."""
        if self._eog is None:
            self._eog = [t for t in range(self.meta.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
        return self._eog

    def is_eog(self, token: int) -> bool:
        return token in self._eog_set

    # ----------------------------------------------------------------------------------------------- compute

    def decode(self, batch: Batch) -> None:
        n = len(batch)
        if n == 0:
            return
        if n > self.n_batch:
            raise InvalidInput(f"batch of {n} tokens exceeds num_batch {self.n_batch}")
        # Placeholder rows trail the batch and want no logits: decoding them first leaves the token rows' outputs
        # as the last decode's, at their own row numbers. Each sequence has rows of one kind only in a step.
        first_image = next((i for i, t in enumerate(batch.tokens) if is_placeholder(t)), n)
        if first_image < n:
            self._decode_images(batch, first_image)
            n = first_image
            if n == 0:
                return
        b = self._batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = batch.tokens[i]
            b.pos[i] = batch.positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = batch.seqs[i]
            b.logits[i] = batch.logits[i]
        status = self._decode_native(b) if self._guard is not None else llama_cpp.llama_decode(self._ctx, b)
        if status != 0:
            raise LocalLLMError(
                f"llama_decode failed with status {status} on a batch of {n} tokens",
                hint="1 means the KV cache is full: lower num_parallel or raise num_ctx",
            )

    def step_clock(self) -> float:
        # llama.cpp's threads wait for each other at every operation, so the calling thread's share follows the step.
        return time.thread_time()

    def _decode_images(self, batch: Batch, start: int) -> None:
        if self.vision is None:
            raise LocalLLMError("a batch holds image placeholders, but the model has no vision projector")
        if any(batch.logits[start:]) or not all(map(is_placeholder, batch.tokens[start:])):
            raise LocalLLMError("image rows must trail the batch and want no logits")
        if self._embd_batch is None:
            self._embd_batch = llama_cpp.llama_batch_init(self.n_batch, self.meta.n_embd, 1)
        rows = self.vision.rows(batch.tokens[start:])
        status = decode_rows(self._ctx, self._embd_batch, rows, batch.positions[start:], batch.seqs[start:])
        if status != 0:
            raise LocalLLMError(f"llama_decode failed with status {status} on {len(rows)} image rows")

    def _decode_native(self, batch) -> int:
        def decode_and_wait() -> int:
            # RPC computes asynchronously: wait here, under the guard, so that reading the logits never blocks.
            status = llama_cpp.llama_decode(self._ctx, batch)
            llama_cpp.llama_synchronize(self._ctx)
            return status

        assert self._guard is not None
        return self._guard.call(decode_and_wait)

    def logits(self, row: int) -> np.ndarray:
        return self.logits_view(row).copy()

    def logits_view(self, row: int) -> np.ndarray:
        """The row's logits in llama.cpp's own buffer: valid until the next decode, never to be written."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
        if not ptr:
            raise LocalLLMError(f"no logits for batch row {row}")
        # A cached array type over the address: numpy's as_array builds a new ctypes type each call.
        values = cast(Any, self._logits_row.from_address(ctypes.addressof(ptr.contents)))  # a ctypes array: a buffer
        return np.frombuffer(values, dtype=np.float32)

    def make_sampler(
        self, options: SamplingOptions, *, grammar: str | None = None, triggers: GrammarTriggers | None = None
    ) -> LlamaCppSampler | GreedySampler:
        if GreedySampler.fits(options, grammar):
            return GreedySampler(self, _biases(self, options))
        return LlamaCppSampler(self, options, grammar, triggers)

    # ----------------------------------------------------------------------------------------------- cache

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, seq, start, end)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        # With a stream per sequence llama.cpp copies across streams only whole: copy, then cut. (In a unified pool
        # the copy shares the cells: no memory moves.)
        llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        if self._guard is not None:  # the copy moves cache data, which may sit on a worker
            self._guard.call(llama_cpp.llama_memory_seq_cp, self._mem, src, dst, -1, -1)
        else:
            llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, dst, n, -1)

    def cache_shape(self) -> CacheShape:
        params = _context_params(self.options, n_seq=self.n_seq, n_ctx=self.n_ctx)
        # A state loads only into a context with the same streams (slots), cell count, KV types and V layout, written
        # by the same llama.cpp.
        fingerprint = (
            f"llama-cpp-python {llama_cpp.__version__}; slots {self.n_seq}; ctx {self.n_ctx}; pool {self.kv_cells}; "
            f"k {params.type_k}; v {params.type_v}; flash {params.flash_attn_type}"
        )
        model = self._model
        recurrent = bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))
        return CacheShape(
            window=max(0, llama_cpp.llama_model_n_swa(self._model)), recurrent=recurrent, fingerprint=fingerprint
        )

    # ----------------------------------------------------------------------------------------------- parts

    def _native(self, work: Callable[..., Any], *args: Any) -> Any:
        """`work(*args)`, through the RPC guard where layers sit on workers (a pooled context's decode reaches them)."""
        return self._guard.call(work, *args) if self._guard is not None else work(*args)

    def _pooled_context(self, pooling: int, options: LoadOptions):
        # A second context over the same weights: pooled output needs embeddings mode, which would slow the
        # generation context. It holds the per-slot context, as one input or several packed into one decode.
        if self._embed_ctx is None:
            opts = options.model_copy(update={"num_batch": self.n_ctx})
            self._embed_ctx = _new_context(self._model, opts, n_seq=MAX_SEQS, n_ctx=self.n_ctx, pooling=pooling)
            self._adapters.set_on(self._embed_ctx)
        return self._embed_ctx

    def _embedder(self) -> LlamaEmbedder:
        pooling = pooling_for(self.meta.pooling)
        return LlamaEmbedder(
            lambda: self._pooled_context(pooling, self.options),
            n_ctx=self.n_ctx,
            n_embd=self.meta.n_embd,
            call=self._native,
        )

    def _reranker(self) -> LlamaReranker:
        # Flash attention off, whatever the flash trial chose for generation: its F16 rounding moves a pair's score
        # by ~1e-3 with the length of the batch it shares, so a document would score by its neighbours.
        no_flash = self.options.model_copy(update={"flash_attn": False})

        def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
            return self.tokenize(text, add_special=add_special, parse_special=parse_special)

        return LlamaReranker(
            pair_layout(self._model, self._vocab),
            tokenize,
            self.token_text,
            lambda: self._pooled_context(llama_cpp.LLAMA_POOLING_TYPE_RANK, no_flash),
            n_ctx=self.n_ctx,
            n_embd=self.meta.n_embd,
            n_cls_out=max(1, llama_cpp.llama_model_n_cls_out(self._model)),
            call=self._native,
        )

    def _mtp_layers(self) -> LlamaMtpLayers:
        return LlamaMtpLayers(
            self._model,
            self._ctx,
            partial(_context_params, self.options, n_seq=self.n_seq, n_ctx=self.n_ctx),
            n_seq=self.n_seq,
            n_ctx=self.n_ctx,
            n_vocab=self.meta.n_vocab,
        )

    def close(self) -> None:
        if self._ctx is None:
            return
        llama_cpp.llama_batch_free(self._batch)
        if self._embd_batch is not None:
            llama_cpp.llama_batch_free(self._embd_batch)
        if self.vision is not None:
            self.vision.close()  # before the weights it reads
        try:
            if self._guard is not None:
                self._guard.call(self._free_native)
                self._guard.close()
            else:
                self._free_native()
        except WorkerLost as exc:
            # Freeing talks to the lost worker through llama.cpp's dead connection and would never return.
            log.error("%s is abandoned, not freed: %s", self.path.name, exc)
        self._ctx = self._embed_ctx = self._model = None

    def _free_native(self) -> None:
        if self._embed_ctx is not None:
            llama_cpp.llama_free(self._embed_ctx)
        llama_cpp.llama_free(self._ctx)
        _free_adapters(self._adapters)
        self._release_weights()


class LlamaCppSampler:
    """llama.cpp's sampler chain, built once per request from its options (factory, not flags in the hot path).

    Order as in llama.cpp's common sampler: logit bias, penalties, grammar, then top-k, typical, top-p, min-p,
    temperature and the seeded draw; temperature 0 is greedy."""

    def __init__(
        self,
        model: LlamaCppModel,
        opts: SamplingOptions,
        grammar: str | None,
        triggers: GrammarTriggers | None = None,
    ):
        self._ctx = model._ctx
        params = llama_cpp.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain = llama_cpp.llama_sampler_chain_init(params)
        # The chain owns every sampler added to it; this one is also fed the prompt's tokens (accept).
        self._penalties = _penalties(model, opts)
        for smpl in _chain_steps(model, opts, grammar, triggers, self._penalties):
            llama_cpp.llama_sampler_chain_add(self._chain, smpl)

    def sample(self, row: int) -> int:
        return llama_cpp.llama_sampler_sample(self._chain, self._ctx, row)

    def accept(self, token: int) -> None:
        # Prompt tokens count for repetition penalties but must not advance a grammar.
        if self._penalties is not None:
            llama_cpp.llama_sampler_accept(self._penalties, token)

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self):
        self.close()


class GreedySampler:
    """Temperature 0 with nothing in the chain but logit biases (ignore_eos bans included): the first largest biased
    logit, read in place. llama.cpp's greedy sampler picks the same token (it too keeps the first of equal maxima)
    after copying the whole vocabulary into a candidate array, which costs ten times more (262k entries for gemma3)
    on every sampled row, drafts included."""

    def __init__(self, model: LlamaCppModel, biases: dict[int, float]):
        self._model = model
        ids = sorted(biases)
        self._ids = np.array(ids, dtype=np.int64)
        self._add = np.array([biases[t] for t in ids], dtype=np.float32)
        self._biased = frozenset(ids)
        self._only_lowers = all(b <= 0 for b in self._add)  # bans and penalties: they cannot lift a token

    @staticmethod
    def fits(opts: SamplingOptions, grammar: str | None) -> bool:
        return opts.temperature <= 0 and not grammar and not _has_penalties(opts)

    def sample(self, row: int) -> int:
        logits = self._model.logits_view(row)
        best = int(np.argmax(logits))
        if not len(self._ids):
            return best
        if best in self._biased:  # the top token is biased itself (say, a banned EOS): apply every bias to a copy
            biased = logits.copy()
            biased[self._ids] += self._add
            return int(np.argmax(biased))
        if self._only_lowers:  # ignore_eos's bans: the unbiased favourite stays on top
            return best
        values = logits[self._ids] + self._add
        j = int(np.argmax(values))
        top, token = float(logits[best]), int(self._ids[j])
        if values[j] > top or (values[j] == top and token < best):
            return token
        return best

    def accept(self, token: int) -> None:
        pass  # no penalties or grammar: nothing follows the tokens

    def close(self) -> None:
        pass


def _has_penalties(opts: SamplingOptions) -> bool:
    return (
        opts.repeat_penalty != 1.0 or bool(opts.presence_penalty) or bool(opts.frequency_penalty)
    ) and opts.repeat_last_n != 0


def _biases(model: LlamaCppModel, opts: SamplingOptions) -> dict[int, float]:
    """Every logit bias the request asks for, ignore_eos's bans on end-of-generation tokens added."""
    biases: dict[int, float] = {}
    for tok, bias in (opts.logit_bias or {}).items():
        if 0 <= int(tok) < model.meta.n_vocab:  # llama.cpp's bias sampler skips ids it has no logit for
            biases[int(tok)] = biases.get(int(tok), 0.0) + float(bias)
    if opts.ignore_eos:
        for tok in model.eog_tokens():
            biases[tok] = float("-inf")
    return biases


def _penalties(model: LlamaCppModel, opts: SamplingOptions) -> Any:
    """llama.cpp's repetition penalties sampler (a llama_sampler pointer), or None where the options ask for none."""
    if not _has_penalties(opts):
        return None
    last_n = model.n_ctx if opts.repeat_last_n == -1 else opts.repeat_last_n
    return llama_cpp.llama_sampler_init_penalties(
        model.meta.n_vocab, last_n, opts.repeat_penalty, opts.frequency_penalty, opts.presence_penalty
    )


def _grammar_sampler(model: LlamaCppModel, grammar: str, triggers: GrammarTriggers | None) -> Any:
    """The grammar step: from the first token, or lazy: free until a trigger matches the answer so far. An opener
    the vocabulary holds as one token triggers as that token; one spelt in pieces becomes an end-anchored pattern."""
    if triggers is None:
        return llama_cpp.llama_sampler_init_grammar(model._vocab, grammar.encode(), b"root")
    tokens: list[int] = []
    patterns = list(triggers.patterns)
    for word in triggers.words:
        spelt = model.tokenize(word, add_special=False, parse_special=True)
        if len(spelt) == 1:
            tokens.append(spelt[0])
        else:
            patterns.append(word_pattern(word))
    c_patterns = (ctypes.c_char_p * len(patterns))(*(p.encode() for p in patterns))
    c_tokens = (llama_cpp.llama_token * len(tokens))(*tokens)
    return llama_cpp.llama_sampler_init_grammar_lazy_patterns(
        model._vocab, grammar.encode(), b"root", c_patterns, len(patterns), c_tokens, len(tokens)
    )


def _chain_steps(
    model: LlamaCppModel,
    opts: SamplingOptions,
    grammar: str | None,
    triggers: GrammarTriggers | None,
    penalties: Any,
):
    wanted = _biases(model, opts)  # the same biases GreedySampler applies: one rule for both
    if wanted:
        biases = (llama_cpp.llama_logit_bias * len(wanted))()
        for i, (tok, bias) in enumerate(wanted.items()):
            biases[i].token, biases[i].bias = llama_cpp.llama_token(tok), bias
        yield llama_cpp.llama_sampler_init_logit_bias(model.meta.n_vocab, len(wanted), biases)
    if penalties is not None:
        yield penalties
    if grammar:
        smpl = _grammar_sampler(model, grammar, triggers)
        if not smpl:
            raise InvalidInput("the grammar (from format / response_format / tools) does not parse")
        yield smpl
    if opts.temperature <= 0:
        yield llama_cpp.llama_sampler_init_greedy()
        return
    if opts.top_k > 0:
        yield llama_cpp.llama_sampler_init_top_k(opts.top_k)
    if opts.typical_p < 1.0:
        yield llama_cpp.llama_sampler_init_typical(opts.typical_p, 1)
    if opts.top_p < 1.0:
        yield llama_cpp.llama_sampler_init_top_p(opts.top_p, 1)
    if opts.min_p > 0.0:
        yield llama_cpp.llama_sampler_init_min_p(opts.min_p, 1)
    yield llama_cpp.llama_sampler_init_temp(opts.temperature)
    seed = llama_cpp.LLAMA_DEFAULT_SEED if opts.seed is None else opts.seed & 0xFFFFFFFF
    yield llama_cpp.llama_sampler_init_dist(seed)
