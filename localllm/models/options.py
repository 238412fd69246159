"""Load and sampling options resolved once: the Modelfile's parameters, then the request's, validated, split by
lifetime, defaults filled (here alone, from LOCALLLM_* settings) and bounded by the model and the machine.

Bounds are checked before any native call.

llama.cpp trusts its numbers: a repeat_last_n of 2^30 is a std::bad_alloc that aborts the process, a num_ctx of 2^30
wraps in a 32-bit field, a context larger than memory allocates until the machine stalls. So every option that
reaches native code is checked here first. A value that the request or the Modelfile set and that breaks a bound is
an InvalidInput naming the value, the bound and what to do; a default (a LOCALLLM_* setting or built in) is clamped
to the bound instead, as Ollama clamps num_ctx to the trained context, so a model with a short context still loads
with the defaults."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from .. import config
from ..api import LoadOptions, LoraAdapter, SamplingOptions, split_options
from ..errors import InvalidInput, ModelFormatError
from ..quant.gguf import GGUFInfo, inspect_gguf
from .plan import plan_memory

if TYPE_CHECKING:
    from .store import ResolvedModel

log = logging.getLogger(__name__)

GIB = 2**30
# llama.cpp's context size (all slots together) is a uint32_t.
MAX_CONTEXT_CELLS = 2**32 - 1
# A default context's KV pool and compute buffer take at most this share of the machine's memory: other models, the
# prefix cache's RAM tier and the user's own programs share the rest.
DEFAULT_CONTEXT_SHARE = 0.25
# The default context where the weights do not say what they were trained for (MLX folders), and the least a default
# is lowered to for memory (below it check_memory says what to do).
FALLBACK_CONTEXT = 4096

Options = TypeVar("Options", bound=BaseModel)


def validate_options(kind: type[Options], values: dict[str, Any]) -> Options:
    """Build LoadOptions / SamplingOptions, turning pydantic's error into one line naming the field."""
    try:
        return kind(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidInput(f"option {where}: {err['msg']} (got {err.get('input')!r})") from None


def resolve_options(model: ResolvedModel, options: dict[str, Any] | None) -> tuple[LoadOptions, SamplingOptions]:
    """What was asked: the Modelfile's parameters, then the request's options on top; split by lifetime. Unset load
    options stay unset here (load_options fills them), so a reload compares what was asked."""
    base_load, base_sampling = split_options(model.parameters)
    req_load, req_sampling = split_options(options)
    load = validate_options(LoadOptions, {**base_load, **req_load})
    sampling = validate_options(SamplingOptions, {**base_sampling, **req_sampling})
    if load.draft is None and model.draft:
        load = load.model_copy(update={"draft": model.draft})
    return load, sampling


def effective_load(load: LoadOptions) -> LoadOptions:
    """Fill unset load options from the environment, so two requests that mean the same thing compare equal: the
    one place their defaults are filled."""
    return load.model_copy(
        update={
            "num_ctx": load.num_ctx or config.CONTEXT_LENGTH.get(),  # None: the model's own (default_context)
            "num_parallel": load.num_parallel or config.NUM_PARALLEL.get(),
            "num_thread": load.num_thread or config.NUM_THREAD.get(),  # None: tuned as it runs
            "kv_type": load.kv_type or config.KV_CACHE_TYPE.get(),
            "flash_attn": config.FLASH_ATTENTION.get() if load.flash_attn is None else load.flash_attn,
            "rpc": ",".join(config.RPC.get()) if load.rpc is None else load.rpc,  # "" (none) stays ""
        }
    )


def load_options(model: ResolvedModel, load: LoadOptions) -> LoadOptions:
    """The options `model` loads with: `load` (as resolve_options made it) with its defaults filled and checked
    against the model and the machine."""
    return bound_load(effective_load(load), load.model_fields_set, model_facts(model.weights, model.format))


def with_context(load: LoadOptions, facts: ModelFacts) -> LoadOptions:
    """`load` (effective_load's) with num_ctx filled where nothing set it: default_context."""
    return load if load.num_ctx else load.model_copy(update={"num_ctx": default_context(load, facts)})


def default_context(load: LoadOptions, facts: ModelFacts) -> int:
    """The context of a load that nothing sized: what the model was trained for, as llama-server serves it, halved
    while its KV pool and compute buffer would take more than DEFAULT_CONTEXT_SHARE of the machine's memory. Its
    total memory, not what is free now: every request at the defaults asks for the same load, and check_memory
    still refuses one that does not fit at the time. Every request asks it: the answers are kept (the facts object
    is _gguf_facts' own, one per file)."""
    key = (id(facts), load.kv_type, load.num_parallel, load.num_batch, config.KV_POOL.get(), total_memory())
    kept = _DEFAULT_CONTEXTS.get(key)
    if kept is not None and kept[0] is facts:
        return kept[1]
    if len(_DEFAULT_CONTEXTS) > 64:
        _DEFAULT_CONTEXTS.clear()
    n_ctx = _default_context(load, facts, key[-1])
    _DEFAULT_CONTEXTS[key] = (facts, n_ctx)
    return n_ctx


_DEFAULT_CONTEXTS: dict[tuple, tuple[ModelFacts, int]] = {}


def _default_context(load: LoadOptions, facts: ModelFacts, total: int | None) -> int:
    trained = facts.context_length or FALLBACK_CONTEXT
    if facts.info is None or total is None:
        return trained
    n_ctx = trained
    while n_ctx > FALLBACK_CONTEXT:
        try:
            plan = plan_memory(facts.info, load.model_copy(update={"num_ctx": n_ctx}))
        except ModelFormatError:  # an architecture without attention metadata: llama.cpp sizes it itself
            return trained
        if plan.kv_total + plan.compute <= total * DEFAULT_CONTEXT_SHARE:
            break
        n_ctx //= 2
    return max(n_ctx, min(trained, FALLBACK_CONTEXT))


def total_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def serves(loaded: LoadOptions, wanted: LoadOptions) -> bool:
    """Whether a model loaded with `loaded` serves a request whose options are `wanted` (both as load_options made
    them): the same options, or the same but for a smaller num_ctx. Clients such as aider ask a different num_ctx on
    every request; reloading for less context only costs time (Ollama reloads; the larger context is kept here)."""
    if wanted == loaded:
        return True
    if wanted.num_ctx is None or loaded.num_ctx is None or wanted.num_ctx > loaded.num_ctx:
        return False
    # bound_load clamps num_batch to the context, so a smaller context may carry a smaller batch for the same ask.
    cells = wanted.num_ctx * (wanted.num_parallel or 1)
    if wanted.num_batch != min(loaded.num_batch, cells):
        return False
    return wanted.model_copy(update={"num_ctx": loaded.num_ctx, "num_batch": loaded.num_batch}) == loaded


def request_context(loaded_ctx: int, asked: LoadOptions) -> int:
    """The context a request runs in: its own num_ctx where it asked for less than the loaded model holds (`serves`
    lets the larger load serve it), so that its prompt and answer are bounded, cut or refused as at its own size."""
    return min(loaded_ctx, asked.num_ctx) if asked.num_ctx else loaded_ctx


def context_size(load: LoadOptions) -> tuple[int, int]:
    """(slots, tokens per slot) of options whose defaults are filled (effective_load): what a backend sizes its
    context by."""
    if load.num_parallel is None or load.num_ctx is None:
        raise ValueError("num_ctx and num_parallel are unset: fill them first (models/options.effective_load)")
    return load.num_parallel, load.num_ctx


def effective_adapters(model: ResolvedModel, load: LoadOptions) -> list[LoraAdapter]:
    """The model's LoRA adapters at the scales this load applies: adapter_scale, when set, overrides each one's."""
    if load.adapter_scale is None:
        return list(model.adapters)
    return [adapter.model_copy(update={"scale": load.adapter_scale}) for adapter in model.adapters]


@dataclass(frozen=True)
class ModelFacts:
    """What the bounds need from the weights' header; None where the format does not say (MLX folders)."""

    context_length: int | None = None
    vocab_size: int | None = None
    info: GGUFInfo | None = None


def model_facts(weights: Path, format: str) -> ModelFacts:
    if format != "gguf":
        return ModelFacts()
    try:
        stat = Path(weights).stat()
    except OSError:
        return ModelFacts()  # the load itself says what is wrong with the file
    return _gguf_facts(Path(weights), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=32)
def _gguf_facts(path: Path, size: int, mtime_ns: int) -> ModelFacts:
    # size and mtime are part of the key so that a .gguf path rewritten in place is read again.
    info = inspect_gguf(path)
    return ModelFacts(context_length=info.context_length, vocab_size=info.vocab_size, info=info)


def _refuse_or_clamp(name: str, value: int, bound: int, explicit: bool, why: str, hint: str) -> int:
    if value <= bound:
        return value
    if explicit:
        raise InvalidInput(f"{name} {value} is over {bound}, {why}", hint=hint)
    log.info("%s %d lowered to %d: %s", name, value, bound, why)
    return bound


def bound_load(load: LoadOptions, explicit: set[str], facts: ModelFacts) -> LoadOptions:
    """Check `load` (effective values: effective_load filled the unset ones) against the model and the
    machine. `explicit` names the options the request or Modelfile set; the others are clamped, not refused."""
    load = with_context(load, facts)
    cores = os.cpu_count() or 1
    threads = load.num_thread  # None: the engine tunes the count as it runs
    if threads is not None:
        threads = _refuse_or_clamp(
            "num_thread",
            threads,
            cores,
            "num_thread" in explicit,
            f"the {cores} CPU cores of this machine",
            hint=f"use at most {cores}; more threads than cores slow decoding down",
        )
    num_ctx = load.num_ctx or 0
    if facts.context_length:
        num_ctx = _refuse_or_clamp(
            "num_ctx",
            num_ctx,
            facts.context_length,
            "num_ctx" in explicit,
            "the context the model was trained on",
            hint=f"use num_ctx {facts.context_length} or less (rope scaling for longer contexts is not offered)",
        )
    slots = load.num_parallel or 1
    if num_ctx * slots > MAX_CONTEXT_CELLS:
        raise InvalidInput(
            f"num_ctx {num_ctx} x num_parallel {slots} is over {MAX_CONTEXT_CELLS} cells, the most a "
            "llama.cpp context holds",
            hint="lower num_ctx or num_parallel",
        )
    # llama.cpp never uses a batch longer than the context; clamping here keeps the memory plan honest.
    batch = min(load.num_batch, num_ctx * slots) if num_ctx else load.num_batch
    return load.model_copy(update={"num_thread": threads, "num_ctx": num_ctx or load.num_ctx, "num_batch": batch})


def check_memory(load: LoadOptions, facts: ModelFacts, name: str) -> None:
    """Refuse a load whose memory plan (`localllm plan`) does not fit the memory available now. Mapped weights are
    left out: the OS pages them in and out as it needs; the KV cache and the compute buffers must be resident."""
    if facts.info is None:
        return
    try:
        plan = plan_memory(facts.info, load)
    except ModelFormatError as exc:  # an architecture without attention metadata: llama.cpp sizes it itself
        log.debug("no memory plan for %s: %s", name, exc)
        return
    needed = plan.kv_total + plan.compute + (0 if load.use_mmap else plan.weights)
    if plan.available is None or needed <= plan.available:
        return
    raise InvalidInput(
        f"{name} with num_ctx {plan.num_ctx} x num_parallel {plan.num_parallel} needs {needed / GIB:.1f} GiB "
        f"(KV cache {plan.kv_total / GIB:.1f} GiB, compute {plan.compute / GIB:.1f} GiB) "
        f"but {plan.available / GIB:.1f} GiB of memory is available",
        hint=f"lower num_ctx or num_parallel, or use kv_type q8_0; `localllm plan {name}` shows the plan",
    )


def bound_sampling(sampling: SamplingOptions, *, n_ctx: int, n_vocab: int) -> SamplingOptions:
    """Check the sampling options against the loaded model: the penalty window and top_k size native buffers."""
    explicit = sampling.model_fields_set
    window = _refuse_or_clamp(
        "repeat_last_n",
        sampling.repeat_last_n,
        n_ctx,
        "repeat_last_n" in explicit,
        "the context of a slot (num_ctx)",
        hint=f"use at most {n_ctx}, or -1 for the whole context",
    )
    top_k = _refuse_or_clamp(
        "top_k",
        sampling.top_k,
        n_vocab,
        "top_k" in explicit,
        "the size of the model's vocabulary",
        hint="use 0 for no top-k limit",
    )
    if (window, top_k) == (sampling.repeat_last_n, sampling.top_k):
        return sampling
    return sampling.model_copy(update={"repeat_last_n": window, "top_k": top_k})
