"""MLX backend: mlx + mlx-lm behind the same Protocol as llama.cpp (backends/base.py).

A loaded model is an MLX folder (config.json, safetensors, tokenizer files) read by `mlx_lm.load`. Each slot owns
its own per-layer KV cache, so trimming (prefix reuse, speculative rewind) and prefix copies are cache operations
on one sequence. A batch that mixes sequences runs each sequence's rows as one forward pass over that sequence's
cache, one sequence after another: on a CPU that is as fast as padding them into one batch (each step costs about
n times one sequence, see reference/mlx-on-linux.md), and it keeps every sequence exact.

Imported only when the MLX backend is chosen (backends/__init__.py turns an ImportError into the install hint)."""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..api import LoadOptions, LoraAdapter, SamplingOptions
from ..errors import InvalidInput, LocalLLMError, ModelFormatError
from ..models.options import context_size
from ..models.plan import Placement
from .base import (
    Batch,
    CacheShape,
    GrammarChecks,
    LoadCheck,
    ModelMeta,
    MtpLayers,
    Reranker,
    SequenceStates,
    ThreadControl,
    Vision,
)

log = logging.getLogger(__name__)

GRAMMAR_UNSUPPORTED = "structured output (grammar / JSON schema) is not supported on the MLX backend yet"


class MlxBackend:
    name = "mlx"

    def check(
        self, path: Path, options: LoadOptions, *, memory: Path, adapters: Sequence[LoraAdapter] = ()
    ) -> LoadCheck:
        return LoadCheck()  # mlx raises Python errors for bad weights: the load itself fails cleanly

    def placement(self, path: Path, options: LoadOptions) -> None:
        return None  # one device, unified memory: nothing to place

    def load(
        self,
        path: Path,
        options: LoadOptions,
        *,
        adapters: Sequence[LoraAdapter] = (),
        projector: Path | None = None,
    ) -> MlxModel:
        import mlx_lm

        n_seq, n_ctx = context_size(options)
        if projector is not None:
            raise InvalidInput(
                "vision projectors are not supported on the MLX backend",
                hint="run the model on llama.cpp (backend llama.cpp) with its GGUF weights",
            )
        if adapters:
            raise InvalidInput(
                "LoRA adapters are not supported on the MLX backend yet",
                hint="run the model on llama.cpp (backend llama.cpp) with its GGUF weights",
            )
        path = Path(path)
        _check_folder(path)
        try:
            # With return_config, mlx_lm.load returns the config too (its annotation says two values).
            model, tokenizer, config = cast(Any, mlx_lm.load)(str(path), return_config=True)
        except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"mlx-lm could not load the MLX folder {path}: {exc}") from None
        _prefer_float32_on_cpu(model)
        _check_cache_kinds(model, config)
        if options.kv_type not in (None, "f16"):
            log.warning(
                "kv_type %s is not available on MLX; the KV cache keeps the model's float type", options.kv_type
            )
        return MlxModel(path, model, tokenizer, config, n_seq=n_seq, n_ctx=n_ctx)


def _check_folder(path: Path) -> None:
    if path.is_file():
        raise ModelFormatError(
            f"{path} is a file; the MLX backend runs MLX model folders",
            hint="make an MLX copy with `localllm create NAME --from MODEL --format mlx`, "
            "or load it with backend llama.cpp",
        )
    if not path.is_dir():
        raise ModelFormatError(
            f"MLX model folder {path} does not exist",
            hint="an MLX model is a folder with config.json and *.safetensors",
        )
    missing = [
        name
        for name, ok in (
            ("config.json", (path / "config.json").is_file()),
            ("*.safetensors", any(path.glob("*.safetensors"))),
        )
        if not ok
    ]
    if missing:
        raise ModelFormatError(f"MLX model folder {path} has no {' or '.join(missing)}")


def _prefer_float32_on_cpu(model) -> None:
    # MLX's CPU kernels are several times slower with fp16/bf16 (quantization scales too) than with f32; on Apple
    # GPUs half precision is the fast path, so only the CPU build is changed.
    if mx.default_device().type == mx.cpu:
        model.set_dtype(mx.float32)
        # Evaluate the casts now: a lazy array belongs to this thread's stream, and the engine thread that decodes
        # later cannot evaluate it ("There is no Stream(cpu, 0) in current thread").
        mx.eval(model.parameters())


def _check_cache_kinds(model, config: dict) -> None:
    # Trimming and prefix copies need caches that keep every position. Sliding-window layers are given full caches
    # (see MlxModel._new_cache); recurrent-state layers (Mamba-style) cannot be trimmed at all.
    kinds = {type(c) for c in make_prompt_cache(model)}
    if not kinds <= {KVCache, RotatingKVCache}:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise ModelFormatError(
            f"model type {config.get('model_type')!r} uses {names} caches, which the MLX backend "
            "cannot trim or share yet",
            hint="run a GGUF of this model on llama.cpp",
        )


# ------------------------------------------------------------------------------------------------------- metadata


def _read_meta(path: Path, model, tokenizer, config: dict) -> ModelMeta:
    from mlx_lm.utils import get_total_parameters

    hf = tokenizer._tokenizer
    bos = hf.bos_token_id
    probe = hf.backend_tokenizer.encode("a", add_special_tokens=True).ids
    n_params = get_total_parameters(model)
    return ModelMeta(
        architecture=str(config.get("model_type", "unknown")),
        n_vocab=int(model.args.vocab_size) if hasattr(model, "args") else hf.backend_tokenizer.get_vocab_size(),
        n_ctx_train=int(config.get("max_position_embeddings") or 0),
        n_embd=int(config.get("hidden_size") or 0),
        bos_token=bos,
        eos_token=_first_eos(config, hf),
        add_bos=bool(bos is not None and probe[:1] == [bos]),
        chat_template=_chat_template(hf),
        n_params=n_params,
        size_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
        description=f"{config.get('model_type', 'unknown')} {n_params / 1e6:.0f}M (MLX)",
    )


def _first_eos(config: dict, hf) -> int | None:
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        return int(eos[0]) if eos else hf.eos_token_id
    return int(eos) if eos is not None else hf.eos_token_id


def _chat_template(hf) -> str | None:
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one is what a chat uses
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


# ------------------------------------------------------------------------------------------------------- token bytes


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable stand-in character of each byte → the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _make_piece_decoder(backend) -> Callable[[str], bytes]:
    """How a vocabulary entry spells its bytes, from the tokenizer's decoder: byte-level BPE or sentencepiece."""
    spec = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = {d.get("type") for d in spec.get("decoders", [spec])}
    if "ByteLevel" in kinds:
        table = _byte_decoder()
        return lambda piece: bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
    if "ByteFallback" in kinds or "Metaspace" in kinds:

        def spm_piece(piece: str) -> bytes:
            byte = _BYTE_TOKEN.match(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

        return spm_piece
    return lambda piece: backend.decode([backend.token_to_id(piece)], skip_special_tokens=False).encode()


# ------------------------------------------------------------------------------------------------------- the model


class MlxModel:
    """A loaded MLX model: weights, tokenizer and one KV cache per sequence. Its one optional part is an embedder,
    for architectures whose inner model gives hidden states."""

    n_batch = 512  # prefill chunk: the scheduler's token budget per step
    kv_pad = 1  # attention spans the cache exactly (no padded grid as in llama.cpp)
    placement: Placement | None = None  # MLX runs the whole model on its one device
    # What MLX does not do here. No projectors (load refuses them). mlx-lm loads language models only, so there is no
    # cross-encoder's classifier head. No sequence states yet: an evicted prefix is prefilled again. No MTP layers:
    # spec_type auto falls back to a draft model or n-gram. Sampling takes no grammars. MLX schedules its own
    # threads: the engine's thread tuner leaves it alone.
    vision: Vision | None = None
    reranker: Reranker | None = None
    states: SequenceStates | None = None
    mtp: MtpLayers | None = None
    grammars: GrammarChecks | None = None
    threads: ThreadControl | None = None

    def __init__(self, path: Path, model, tokenizer, config: dict, *, n_seq: int, n_ctx: int):
        self.path = path
        self.weights: Hashable = ("mlx", id(self))  # every MLX load holds its own copy of the weights
        self._model = model
        self._hf = tokenizer._tokenizer
        self._backend_tok = self._hf.backend_tokenizer
        self.meta = _read_meta(path, model, tokenizer, config)
        self.n_seq = n_seq
        self.n_ctx = n_ctx
        self.kv_cells = n_seq * n_ctx  # each sequence's cache is its own
        self._n_layers = len(model.layers)
        self._caches: list[list[KVCache]] = [self._new_cache() for _ in range(n_seq)]
        self._outputs: dict[int, mx.array] = {}  # batch row -> logits [n_vocab] of the last decode
        self._eog = {int(t) for t in tokenizer.eos_token_ids}
        self._special = {i for i, tok in self._backend_tok.get_added_tokens_decoder().items() if tok.special}
        self._piece_bytes = _make_piece_decoder(self._backend_tok)
        self._bytes_cache: dict[int, bytes] = {}
        inner = getattr(model, "model", None)  # the trunk without the output head (mlx-lm's model classes)
        self.embedder = MlxEmbedder(inner, n_ctx) if callable(inner) else None

    def _new_cache(self) -> list[KVCache]:
        # Plain caches for every layer, sliding-window ones included: the model still masks to its window, and a
        # cache that keeps every position can be trimmed and copied at any length (a rotating one cannot).
        return [KVCache() for _ in range(self._n_layers)]

    def cached_tokens(self, seq: int) -> int:
        """How many positions sequence `seq` holds."""
        return self._caches[seq][0].offset

    # ----------------------------------------------------------------------------------------------- text

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        tok = self._backend_tok
        # encode_special_tokens=True makes "<|im_end|>" in user text plain characters instead of a control token.
        tok.encode_special_tokens = not parse_special
        try:
            return tok.encode(text, add_special_tokens=add_special).ids
        finally:
            tok.encode_special_tokens = False

    def token_bytes(self, token: int) -> bytes:
        piece = self._bytes_cache.get(token)
        if piece is None:
            piece = self._token_bytes(token)
            self._bytes_cache[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        if token in self._special:  # its own spelling, though it streams as nothing (token_bytes)
            return self._backend_tok.id_to_token(token) or ""
        return self.token_bytes(token).decode("utf-8", "replace")

    def _token_bytes(self, token: int) -> bytes:
        if token in self._special:
            return b""  # control tokens render as nothing, as llama.cpp's token_to_piece does
        text = self._backend_tok.id_to_token(token)
        if text is None:
            raise InvalidInput(f"token {token} is outside the vocabulary of {self.meta.n_vocab}")
        if token in self._backend_tok.get_added_tokens_decoder():
            return text.encode()
        return self._piece_bytes(text)

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    # ----------------------------------------------------------------------------------------------- compute

    def decode(self, batch: Batch) -> None:
        self._outputs = {}
        rows_by_seq = self._group_rows(batch)
        try:
            for seq, rows in rows_by_seq.items():
                self._forward(seq, rows, batch)
            mx.eval(list(self._outputs.values()), [self._cache_state(seq) for seq in rows_by_seq])
        except (RuntimeError, ValueError) as exc:
            raise LocalLLMError(f"MLX decode failed on a batch of {len(batch)} tokens: {exc}") from None

    def _group_rows(self, batch: Batch) -> dict[int, list[int]]:
        """Rows per sequence, checked to continue that sequence's cache position by position."""
        rows_by_seq: dict[int, list[int]] = {}
        for row, seq in enumerate(batch.seqs):
            if not 0 <= seq < self.n_seq:
                raise InvalidInput(f"batch row {row} names sequence {seq}; this model has {self.n_seq}")
            rows_by_seq.setdefault(seq, []).append(row)
        for seq, rows in rows_by_seq.items():
            start = self.cached_tokens(seq)
            positions = [batch.positions[r] for r in rows]
            if positions != list(range(start, start + len(rows))):
                raise LocalLLMError(
                    f"sequence {seq} holds {start} tokens but the batch gives positions "
                    f"{positions[0]}..{positions[-1]}; rows must continue the cache"
                )
            if start + len(rows) > self.n_ctx:
                raise LocalLLMError(
                    f"sequence {seq} would hold {start + len(rows)} tokens; its context is {self.n_ctx}",
                    hint="the KV cache is full: raise num_ctx",
                )
        return rows_by_seq

    def _forward(self, seq: int, rows: list[int], batch: Batch) -> None:
        """One forward pass of `seq`'s rows; logits are kept only for rows that asked for them."""
        cache = self._caches[seq]
        tokens = [batch.tokens[r] for r in rows]
        wanted = [i for i, r in enumerate(rows) if batch.logits[r]]
        # Rows before the first wanted one only fill the cache: their output head is never built, because MLX
        # evaluates lazily and nothing reads those logits (saves the vocab projection on long prefills).
        first = wanted[0] if wanted else len(rows)
        if first:
            self._model(mx.array([tokens[:first]]), cache=cache)
        if not wanted:
            return
        logits = self._model(mx.array([tokens[first:]]), cache=cache)[0]  # [n_rows - first, n_vocab]
        picked = logits[mx.array([i - first for i in wanted])].astype(mx.float32)
        for k, i in enumerate(wanted):
            self._outputs[rows[i]] = picked[k]

    def _cache_state(self, seq: int) -> list:
        return [(c.keys, c.values) for c in self._caches[seq] if c.keys is not None]

    def row_logits(self, row: int) -> mx.array:
        """Logits of `row` of the last decode, as an MLX array [n_vocab] (samplers stay on the device)."""
        out = self._outputs.get(row)
        if out is None:
            raise LocalLLMError(f"no logits for batch row {row}: it was not marked for output in the last decode")
        return out

    def logits(self, row: int) -> np.ndarray:
        return np.array(self.row_logits(row), dtype=np.float32)

    def make_sampler(self, options: SamplingOptions, *, grammar: str | None = None) -> MlxSampler:
        if grammar is not None:
            raise InvalidInput(GRAMMAR_UNSUPPORTED, hint="use a GGUF model on llama.cpp for format / response_format")
        return MlxSampler(self, options)

    # ----------------------------------------------------------------------------------------------- cache

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        held = self.cached_tokens(seq)
        start = max(start, 0)
        if 0 <= end < held and end > start:
            raise InvalidInput(f"the MLX backend can only drop the end of a sequence, not positions {start}..{end}")
        if start == 0:
            self._caches[seq] = self._new_cache()  # frees the buffers instead of keeping them for reuse
        elif start < held:
            for layer in self._caches[seq]:
                layer.trim(held - start)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if src == dst:
            self.remove(dst, n)
            return
        n = max(0, min(n, self.cached_tokens(src)))
        fresh = self._new_cache()
        for source, target in zip(cast(list[Any], self._caches[src]), fresh):
            if n:
                # Real copies, so the source's later in-place cache writes never show up in the destination.
                target.keys = mx.contiguous(source.keys[..., :n, :])
                target.values = mx.contiguous(source.values[..., :n, :])
                target.offset = n
        self._caches[dst] = fresh
        mx.eval(self._cache_state(dst))

    def cache_shape(self) -> CacheShape:
        return CacheShape()  # every layer keeps a full cache here (see _new_cache): any cut is exact

    def close(self) -> None:
        self._caches = []
        self._outputs = {}
        self._model = None
        self.embedder = None


class MlxEmbedder:
    """The Embedder part: the trunk's final hidden states (final norm applied), mean-pooled and normalised."""

    def __init__(self, trunk: Callable[[mx.array], mx.array], n_ctx: int):
        self._trunk, self._n_ctx = trunk, n_ctx

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        return [self._embed_one(tokens) for tokens in inputs]

    def _embed_one(self, tokens: Sequence[int]) -> list[float]:
        if not 0 < len(tokens) <= self._n_ctx:
            raise InvalidInput(f"input is {len(tokens)} tokens; embeddings take 1 to {self._n_ctx}")
        hidden = self._trunk(mx.array([list(tokens)]))[0].astype(mx.float32)  # [n_tokens, n_embd]
        pooled = hidden.mean(axis=0)
        norm = mx.maximum(mx.linalg.norm(pooled), 1e-12)
        return np.array(pooled / norm, dtype=np.float64).tolist()


# ------------------------------------------------------------------------------------------------------- sampling

LogitsFilter = Callable[[mx.array], mx.array]


def apply_typical(logprobs: mx.array, mass: float) -> mx.array:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to `mass`."""
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    probs = mx.exp(logprobs)
    entropy = -mx.sum(mx.where(probs > 0, probs * logprobs, 0.0), axis=-1, keepdims=True)
    order = mx.argsort(mx.abs(-logprobs - entropy), axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < mass  # always keeps the first
    keep = mx.put_along_axis(mx.zeros(keep_sorted.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, -mx.inf)


def make_filters(opts: SamplingOptions, n_vocab: int) -> list[LogitsFilter]:
    """The truncation steps in llama.cpp's order (top-k, typical, top-p, min-p), built once per request."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    filters: list[LogitsFilter] = []
    if 0 < opts.top_k < n_vocab:
        filters.append(lambda x: apply_top_k(x, opts.top_k))
    if opts.typical_p < 1.0:
        filters.append(lambda x: apply_typical(x, opts.typical_p))
    if opts.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, opts.top_p))
    if opts.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, opts.min_p))
    return filters


def make_processors(opts: SamplingOptions, *, n_ctx: int, eog: set[int]) -> list:
    """Logit bias (plus -inf on end-of-generation tokens for ignore_eos) and the repetition penalties."""
    from mlx_lm.sample_utils import make_logits_processors

    bias = {int(t): float(b) for t, b in opts.logit_bias.items()}
    if opts.ignore_eos:
        bias.update({t: -float("inf") for t in eog})
    last_n = n_ctx if opts.repeat_last_n == -1 else opts.repeat_last_n
    penalties = last_n > 0
    return make_logits_processors(
        logit_bias=bias or None,
        repetition_penalty=opts.repeat_penalty if penalties and opts.repeat_penalty != 1.0 else None,
        repetition_context_size=last_n,
        presence_penalty=opts.presence_penalty if penalties else None,
        presence_context_size=last_n,
        frequency_penalty=opts.frequency_penalty if penalties else None,
        frequency_context_size=last_n,
    )


class MlxSampler:
    """mlx-lm's processors and filters, then a seeded draw; temperature 0 is greedy.

    The random key belongs to the sampler, not to MLX's global state, so a seeded request gives the same tokens
    whatever other slots sample in between."""

    def __init__(self, model: MlxModel, opts: SamplingOptions):
        self._model = model
        self._processors = make_processors(opts, n_ctx=model.n_ctx, eog=model._eog)
        self._filters = make_filters(opts, model.meta.n_vocab)
        self._temperature = opts.temperature
        self._history_limit = max(opts.repeat_last_n, 64) if opts.repeat_last_n != -1 else model.n_ctx
        self._history: list[int] = []
        seed = secrets.randbits(32) if opts.seed is None else opts.seed & 0xFFFFFFFF
        self._key = mx.random.key(seed)

    def sample(self, row: int) -> int:
        logits = self._model.row_logits(row)[None]  # [1, n_vocab]
        if self._processors:
            history = mx.array(self._history, dtype=mx.int32)
            for process in self._processors:
                logits = process(history, logits)
        token = int(cast(int, self._draw(logits).item()))
        self.accept(token)
        return token

    def _draw(self, logits: mx.array) -> mx.array:
        if self._temperature <= 0:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for keep in self._filters:
            logprobs = keep(logprobs)
        self._key, draw_key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self._temperature), key=draw_key)

    def accept(self, token: int) -> None:
        self._history.append(token)
        if len(self._history) > 2 * self._history_limit:  # the penalties only look at the last window
            del self._history[: -self._history_limit]

    def close(self) -> None:
        self._history = []
