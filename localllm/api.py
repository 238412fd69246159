"""Every wire and user-facing type, shared by the CLI, the TUI, the REST server and the Modelfile front end.

Field names follow Ollama's API (api/types.go) so the same JSON flows through every surface. Options are split by
lifetime: LoadOptions need a reload of the model, SamplingOptions apply per request. `split_options` turns Ollama's
flat `options` object into the two."""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
)

from .errors import InvalidInput

log = logging.getLogger(__name__)


def now() -> datetime:
    return datetime.now(timezone.utc)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, protected_namespaces=())


# ---------------------------------------------------------------------------------------------------------- durations


def _seconds(value: Any) -> Any:
    from .config import parse_duration

    return value if value is None else parse_duration(value)  # ValueError says what a duration looks like


def _wire_seconds(seconds: float) -> float:
    return -1 if math.isinf(seconds) else seconds  # JSON has no infinity: -1 is Ollama's "forever"


# Ollama's api.Duration (keep_alive): a number of seconds or a Go duration string ("5m", "1h30m"), read as seconds;
# negative (or past a hundred years) is forever (inf), 0 unloads as soon as the request ends.
Duration = Annotated[
    float,
    BeforeValidator(_seconds),
    PlainSerializer(_wire_seconds, when_used="json"),
    WithJsonSchema(
        {"anyOf": [{"type": "number"}, {"type": "string"}], "description": 'seconds, or "5m", "1h30m"; -1 forever'}
    ),
]
_DURATION = TypeAdapter(Duration)


def parse_keep_alive(value: str | float, *, what: str = "keep_alive") -> float:
    """A keep_alive typed by hand (the CLI's --keepalive) as Duration reads it; InvalidInput naming `what`."""
    try:
        return _DURATION.validate_python(value)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise InvalidInput(f"{what} {value!r} is not valid: {reason}") from None


# ---------------------------------------------------------------------------------------------------------- options

SpecType = Literal["auto", "none", "ngram", "draft", "mtp"]
BackendName = Literal["auto", "llama.cpp", "mlx"]
KVType = Literal["f16", "q8_0", "q4_0"]
# Every count below reaches a 32-bit C field; the model and the machine bound them further (models/options.py).
INT32_MAX = 2**31 - 1


# LoRA scales beyond this are never useful (1 applies the adapter as trained) and only amplify noise.
ADAPTER_SCALE_LIMIT = 16.0


class LoraAdapter(_Model):
    """A LoRA adapter applied when a model loads: a GGUF LoRA file and the scale it is applied with."""

    model_config = ConfigDict(frozen=True, extra="ignore", protected_namespaces=())

    path: str
    scale: float = Field(1.0, ge=-ADAPTER_SCALE_LIMIT, le=ADAPTER_SCALE_LIMIT)


class LoadOptions(_Model):
    """Options fixed when a model is loaded; changing any of them reloads the model."""

    num_ctx: int | None = Field(
        None, ge=16, le=INT32_MAX, description="context per slot, in tokens (never divided across slots)"
    )
    num_parallel: int | None = Field(None, ge=1, le=256, description="slots: requests decoded at once")
    num_batch: int = Field(512, ge=1, le=INT32_MAX, description="most tokens decoded in one step")
    num_gpu: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="layers offloaded to the GPU; default all that fit"
    )
    num_thread: int | None = Field(
        None, ge=1, le=INT32_MAX, description="CPU threads for decoding (unset: chosen as it runs)"
    )
    flash_attn: bool | None = Field(None, description="flash attention where the backend has it")
    kv_type: KVType | None = Field(None, description="KV cache element type")
    use_mmap: bool = Field(True, description="map the weights file instead of reading it")
    backend: BackendName = Field("auto", description="auto picks mlx for MLX folders, llama.cpp for GGUF")
    draft: str | None = Field(None, description="draft model for speculative decoding (Modelfile DRAFT)")
    embedding: bool = Field(False, description="load for embeddings (pooled output)")
    adapter_scale: float | None = Field(
        None,
        ge=-ADAPTER_SCALE_LIMIT,
        le=ADAPTER_SCALE_LIMIT,
        description="scale of every LoRA adapter (overrides each ADAPTER line's)",
    )
    rpc: str | None = Field(
        None,
        max_length=1024,
        description="RPC workers (`localllm worker`) to place layers "
        'on, host:port[,host:port...]; default LOCALLLM_RPC, "" for none',
    )

    @field_validator("rpc")
    @classmethod
    def _workers(cls, value: str | None) -> str | None:
        from .config import parse_endpoints

        return None if value is None else ",".join(parse_endpoints(value))  # ValueError names the bad one


class SamplingOptions(_Model):
    """Options that apply to one request. NaN or infinity would reach the C sampler chain (a -inf logit bias is a
    ban, and stays allowed)."""

    temperature: float = Field(0.8, ge=0.0, allow_inf_nan=False, description="0 is greedy")
    top_k: int = Field(40, ge=0, le=INT32_MAX)
    top_p: float = Field(0.9, ge=0.0, le=1.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    typical_p: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    repeat_last_n: int = Field(64, ge=-1, le=INT32_MAX)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    num_predict: int = Field(
        -1, ge=-2, le=INT32_MAX, description="most tokens to generate; -1 until the context is full"
    )
    logit_bias: dict[int, float] = Field(default_factory=dict)

    @field_validator("logit_bias")
    @classmethod
    def _no_nan_bias(cls, biases: dict[int, float]) -> dict[int, float]:
        if any(math.isnan(bias) for bias in biases.values()):
            raise ValueError("a logit bias is NaN")
        return biases

    ignore_eos: bool = False
    spec_type: SpecType = Field("auto", description="speculative decoding: auto, none, ngram, draft, mtp")
    spec_max_draft: int = Field(
        32,
        ge=0,
        le=64,
        description="most draft tokens verified per step (the draft window "
        "sizes each draft below this from its acceptance and cost)",
    )
    spec_min_draft: int = Field(
        0,
        ge=0,
        le=64,
        description="fewest draft tokens a step verifies whenever the drafter has them (llama-server's --draft-min): "
        "above 0, drafts are made whatever they cost, so speculation can then run slower than without it",
    )
    keep_prefix: bool = Field(
        False,
        description="pin this conversation's prompt and answer in the prefix cache, so "
        "it comes back without prefill even after other conversations took its slot",
    )
    deterministic: bool = Field(
        False,
        description="the same request answers the same text every time (with temperature 0 or a seed): it runs "
        "alone, prefills its whole prompt and never speculates",
    )


LOAD_OPTION_NAMES = frozenset(LoadOptions.model_fields)
SAMPLING_OPTION_NAMES = frozenset(SamplingOptions.model_fields)
# Ollama options we accept and ignore because they have no meaning here (documented for users who copy Modelfiles).
IGNORED_OPTION_NAMES = frozenset(
    {
        "num_keep",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "penalize_newline",
        "numa",
        "main_gpu",
        "low_vram",
        "vocab_only",
        "use_mlock",
        "tfs_z",
        "num_gqa",
    }
)


def split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split Ollama's flat options into (load, sampling) dicts; an unknown name is an InvalidInput naming it."""
    load: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name in LOAD_OPTION_NAMES:
            load[name] = value
        elif name in SAMPLING_OPTION_NAMES:
            sampling[name] = value
        elif name not in IGNORED_OPTION_NAMES:
            raise InvalidInput(
                f"unknown option {name!r}",
                hint="see `localllm show MODEL --parameters` or Ollama's list of Modelfile parameters",
            )
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    return load, sampling


def request_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """A REST request's `options` as Ollama reads them: a null value is skipped and an unknown or obsolete name
    (`f16_kv`, `logits_all`, ...) is dropped with a warning, because clients send both. The CLI and Modelfiles keep
    the strict checks of split_options and parse_option."""
    kept: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if value is None:
            continue
        if name in LOAD_OPTION_NAMES or name in SAMPLING_OPTION_NAMES:
            kept[name] = value
        elif name not in IGNORED_OPTION_NAMES:
            log.warning("ignoring unknown option %r (%s)", name, _unknown_option(name).split("; ", 1)[-1])
    return kept


def parse_option(name: str, value: Any) -> Any:
    """One option (Ollama's names) as its typed value, for a Modelfile PARAMETER or a chat's `/set parameter`.

    Returns None for an Ollama option we accept and ignore; raises InvalidInput naming the option and the problem."""
    try:
        load, sampling = split_options({name: value})
    except InvalidInput:
        raise InvalidInput(_unknown_option(name)) from None
    if name == "stop":
        return value
    kind, values = (LoadOptions, load) if load else (SamplingOptions, sampling)
    if not values:
        return None
    try:
        return getattr(kind.model_validate(values), name)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"]
        raise InvalidInput(f"parameter {name} {value!r}: {reason[0].lower()}{reason[1:]}") from None


def _unknown_option(name: str) -> str:
    known = sorted(LOAD_OPTION_NAMES | SAMPLING_OPTION_NAMES)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known parameters: {', '.join(known)}"
    return f"unknown parameter {name!r}{hint}"


# ---------------------------------------------------------------------------------------------------------- messages


class ToolCallFunction(_Model):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Model):
    function: ToolCallFunction
    id: str | None = None


class Message(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, value: Any) -> Any:
        """`content: null` (an assistant turn that only called tools, as LangChain sends it) reads as ""."""
        return "" if value is None else value


class ToolFunction(_Model):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolCallDelta(_Model):
    """A tool call as it is generated (localllm extension, what OpenAI streams): a call's first delta has its id and
    name, the next ones pieces of its arguments' JSON text."""

    index: int = 0
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Tool(_Model):
    type: Literal["function"] = "function"
    function: ToolFunction


Format = Literal["json", ""] | dict[str, Any] | None


# ---------------------------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class GrammarTriggers:
    """When a lazy grammar takes over (chat/call_formats.py): `words` are literal openers (a backend may watch for
    them as one token), `patterns` regular expressions over the answer so far that end where the grammar begins."""

    patterns: tuple[str, ...] = ()
    words: tuple[str, ...] = ()


class _InferenceRequest(_Model):
    model: str
    format: Format = None
    options: dict[str, Any] = Field(default_factory=dict)
    stream: bool = True
    keep_alive: Duration | None = None
    think: bool | str | None = Field(
        None,
        description='thinking on a reasoning model: true, false, "low", '
        '"medium" or "high"; unset leaves the model\'s default',
    )
    truncate: bool = Field(False, description="drop the oldest prompt tokens on overflow instead of failing")
    logprobs: bool = Field(False, description="return each generated token's log-probability")
    top_logprobs: int = Field(0, ge=0, le=20, description="and this many most likely alternatives per token")

    @field_validator("options", mode="before")
    @classmethod
    def _null_options(cls, value: Any) -> Any:
        return {} if value is None else value


class InfillFile(_Model):
    """Another file's text for fill in the middle (llama-server's input_extra entries)."""

    filename: str = Field("tmp", max_length=4096)
    text: str


class GenerateRequest(_InferenceRequest):
    prompt: str = ""
    suffix: str | None = Field(None, description="text after the cursor: the answer fills in the middle")
    input_extra: list[InfillFile] | None = Field(
        None, max_length=1024, description="other files, put before the code (llama-server's; localllm extension)"
    )
    middle: str | None = Field(
        None, description="text after the middle token, the cursor line's start (llama-server's /infill prompt)"
    )
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


# Messages one conversation may hold: far more turns than a context holds, few enough that a request is refused before
# many seconds go into parsing and templating it (Ollama sets none; a chat template spends about a line per message).
MAX_MESSAGES = 10_000


class ChatRequest(_InferenceRequest):
    messages: list[Message] = Field(default_factory=list)  # MAX_MESSAGES at most (client/prompts.py checks)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description="auto, none, required or a function")
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call per answer (localllm extension)")


class EmbedRequest(_Model):
    model: str
    input: str | list[str] = Field(description='text(s) to embed; "" or [] only loads the model')
    input_tokens: list[list[int]] | None = Field(
        None, description="inputs as token ids instead of text (OpenAI's int[] / int[][] input; localllm extension)"
    )
    dimensions: int | None = Field(None, ge=1, description="keep the first n dimensions, re-normalized")
    truncate: bool = True
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: Duration | None = None


class EmbedResponse(_Model):
    model: str
    embeddings: list[list[float]]
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0


MAX_RERANK_DOCUMENTS = 1024  # documents one rerank request scores (Cohere's limit is 1000; each is one sequence)
MAX_EMBED_INPUTS = 2048  # inputs one embedding request holds (OpenAI's limit)


class RerankRequest(_Model):
    """The rerank request llama-server, Jina and Cohere share: score each document against the query."""

    model: str
    query: str
    documents: list[str] = Field(max_length=MAX_RERANK_DOCUMENTS)
    top_n: int | None = Field(None, ge=1, description="return the n best documents only (default: all)")
    return_documents: bool = Field(False, description="echo each result's document text")
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: Duration | None = None


class RerankDocument(_Model):
    text: str


class RerankResult(_Model):
    index: int  # the document's position in the request
    relevance_score: float  # the classifier's output (a logit, as llama-server reports it): higher is more relevant
    document: RerankDocument | None = None


class RerankUsage(_Model):
    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(_Model):
    model: str
    object: Literal["list"] = "list"
    usage: RerankUsage = Field(default_factory=RerankUsage)
    results: list[RerankResult]


# ---------------------------------------------------------------------------------------------------------- responses


class Timings(_Model):
    """Ollama's timing fields (nanoseconds) plus ours: cached and speculative counts."""

    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    prompt_cache_count: int = Field(0, description="prompt tokens reused from the prefix cache")
    truncated_tokens: int = Field(0, description="prompt tokens dropped because the request asked to truncate")
    draft_count: int = Field(0, description="speculative tokens drafted")
    draft_accepted: int = Field(0, description="speculative tokens accepted")
    draft_mean_accepted: float = Field(0.0, description="draft tokens accepted per verification step, on average")
    draft_duration: int = Field(0, description="time spent drafting (ns): the draft model or n-gram lookup")
    verify_duration: int = Field(0, description="time of the steps that verified this request's drafts (ns)")
    sample_duration: int = Field(0, description="time sampling the rows of those steps (ns)")


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


DoneReason = Literal["stop", "length", "cancelled", "load", "unload", "error"]


class GenerateChunk(Timings):
    model: str
    created_at: datetime = Field(default_factory=now)
    response: str = ""
    thinking: str | None = None
    done: bool = False
    done_reason: DoneReason | None = None
    context: list[int] | None = None
    tokens: list[int] | None = Field(None, description="token ids in this chunk (localllm extension)")
    logprobs: list[TokenLogprob] | None = None
    stop_sequence: str | None = Field(None, description="the stop string that ended the answer (extension)")


class ChatChunk(Timings):
    model: str
    created_at: datetime = Field(default_factory=now)
    message: Message = Field(default_factory=lambda: Message(role="assistant"))
    done: bool = False
    done_reason: DoneReason | None = None
    repairs: list[str] | None = Field(None, description="near tool calls made whole, and how (localllm extension)")
    tool_call_deltas: list[ToolCallDelta] | None = Field(
        None,
        description="a forced tool call as it is "
        "generated (localllm extension; the last chunk's "
        "message carries the whole call)",
    )
    tokens: list[int] | None = Field(None, description="token ids in this chunk (localllm extension)")
    logprobs: list[TokenLogprob] | None = None
    stop_sequence: str | None = Field(None, description="the stop string that ended the answer (extension)")


# ---------------------------------------------------------------------------------------------------------- models


class ModelDetails(_Model):
    parent_model: str = ""
    format: str = "gguf"
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ModelSummary(_Model):
    """One row of `localllm list` and /api/tags."""

    name: str
    model: str
    modified_at: datetime
    size: int
    digest: str
    details: ModelDetails = Field(default_factory=ModelDetails)


class ListResponse(_Model):
    models: list[ModelSummary]


class QuantizationReport(_Model):
    """What quantizing cost, measured against the source model on a fixed built-in text (`create --quantize`)."""

    quantize: str = Field(description="the type quantized to, e.g. Q4_K_M")
    source: str = Field(description="the model that was quantized")
    text: str = Field(description="which built-in text was compared")
    tokens: int = Field(description="positions compared")
    top1_agreement: float = Field(description="share of positions where both models' likeliest next token agree")
    mean_kl: float = Field(description="mean KL divergence source || quantized of the next-token distribution, nats")
    perplexity_source: float
    perplexity_quantized: float
    size_source: int = Field(description="bytes")
    size_quantized: int = Field(description="bytes")
    size_ratio: float = Field(description="size_quantized / size_source")
    decode_tps_source: float = Field(description="tokens/s generating one sequence (same machine, same run)")
    decode_tps_quantized: float


class ShowRequest(_Model):
    model: str = Field(validation_alias=AliasChoices("model", "name"))  # `name`: Ollama's deprecated spelling
    verbose: bool = False


class ShowResponse(_Model):
    license: str = ""
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    system: str = ""
    details: ModelDetails = Field(default_factory=ModelDetails)
    model_info: dict[str, Any] = Field(default_factory=dict)
    projector_info: dict[str, Any] | None = Field(None, description="the vision projector's metadata, as Ollama's")
    capabilities: list[str] = Field(default_factory=list)
    modified_at: datetime | None = None
    path: str | None = Field(None, description="weights file or folder on disk (localllm extension)")
    draft: str | None = None
    parts: list[str] = Field(default_factory=list, description="every file of a split GGUF, in order")
    adapters: list[LoraAdapter] = Field(default_factory=list, description="LoRA adapters applied at load")
    quantization_report: QuantizationReport | None = None


class PullRequest(_Model):
    model: str = Field(validation_alias=AliasChoices("model", "name"))  # `name`: Ollama's deprecated spelling
    insecure: bool = False
    stream: bool = True


class PullProgress(_Model):
    """One value of a pull's progress stream, shared by the CLI bar and /api/pull."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


class CreateRequest(_Model):
    """What a Modelfile says, and what /api/create accepts."""

    model: str = Field(validation_alias=AliasChoices("model", "name"))  # `name`: Ollama's deprecated spelling
    from_: str | None = Field(None, alias="from")
    projector: str | None = Field(None, description="a vision projector (`clip` GGUF) path: a Modelfile's second FROM")
    modelfile: str | None = None
    template: str | None = None
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    messages: list[Message] = Field(default_factory=list)
    adapters: dict[str, str] = Field(default_factory=dict)
    adapter_scales: dict[str, float] = Field(default_factory=dict, description="adapter path -> scale (default 1)")
    draft: str | None = None
    quantize: str | None = None
    allow_requantize: bool = Field(False, description="quantize weights that are already quantized (loses quality)")
    imatrix: str | None = Field(None, description="importance matrix file (GGUF, from llama-imatrix) for quantize")
    format: Literal["gguf", "mlx"] | None = None
    files: dict[str, str] = Field(
        default_factory=dict,
        description='uploaded blobs by file name (Ollama\'s create(files=...)): {"model.gguf": "sha256:..."}',
    )
    stream: bool = True


class CopyRequest(_Model):
    source: str
    destination: str


class DeleteRequest(_Model):
    model: str = Field(validation_alias=AliasChoices("model", "name"))  # `name`: Ollama's deprecated spelling


class DeviceLayers(_Model):
    """Where part of a loaded model runs: a device (CPU, CUDA0, RPC0) and the layers it holds."""

    device: str
    description: str = ""
    layers: int = 0  # repeating layers, plus one for the output head
    memory: int = 0  # bytes placed there: weights, KV cache, compute buffer (estimate)


class DraftProcess(_Model):
    """The draft model a loaded model speculates with: loaded beside it, with its own KV for every slot."""

    model: str
    size: int = Field(0, description="bytes of its weights")
    kv_cells: int = Field(0, description="KV cache tokens it holds for the slots (slots x context)")
    threads: int = Field(0, description="CPU threads of its decode steps")


class ProcessModel(_Model):
    """One row of `localllm ps` and /api/ps."""

    name: str
    model: str
    size: int = 0
    digest: str = ""
    details: ModelDetails = Field(default_factory=ModelDetails)
    expires_at: datetime | None = None
    size_vram: int = 0
    context_length: int = 0
    backend: str = "llama.cpp"
    slots_busy: int = 0
    slots_total: int = 0
    queue_depth: int = 0
    kv_type: str = "f16"
    gpu_layers: int = 0
    speculation: str = "none"
    threads: int = 0  # CPU threads of its decode steps now (llama.cpp; 0 where the backend chooses)
    threads_auto: bool = False  # chosen as it runs (LOCALLLM_NUM_THREAD auto), not pinned
    flash_attn: bool | None = Field(
        None, description="flash attention as its context runs: on, off, or null where the backend decides"
    )
    flash_attn_measured: bool = Field(False, description="flash_attn was chosen by timing both on this machine")
    draft_count: int = 0
    draft_accepted: int = 0
    draft: DraftProcess | None = None
    # "removed": its model was deleted; "draining": a waiting request needs it gone (another model, or other load
    # options). Either way it takes no new requests and unloads when its running requests end.
    status: str | None = None
    load_waiting: int = Field(
        0, description="requests for this model waiting in the pool's queue, for a reload with their load options"
    )
    kv_cells: int = Field(0, description="KV cache tokens the slots share (the pool; LOCALLLM_KV_POOL)")
    kv_used: int = Field(0, description="KV cache tokens the slots' caches hold now, of kv_cells")
    cache_ram_bytes: int = Field(0, description="prefix cache: saved prompt prefixes held in host RAM")
    cache_ram_limit: int = Field(0, description="LOCALLLM_CACHE_RAM for this model")
    cache_disk_bytes: int = Field(0, description="prefix cache: saved prompt prefixes on disk")
    cache_disk_limit: int = Field(0, description="LOCALLLM_CACHE_DISK for this model (0: off)")
    prefix_cache_hits: dict[str, int] = Field(
        default_factory=dict, description="requests that reused a prefix, by tier: slot, ram, disk"
    )
    prefix_cache_tokens: dict[str, int] = Field(default_factory=dict, description="prompt tokens reused, by tier")
    shares_weights_with: list[str] = Field(
        default_factory=list, description="other loaded models that use the same weights in memory"
    )
    placement: list[DeviceLayers] = Field(default_factory=list)  # where its layers run; empty where unknown
    missing_workers: list[str] = Field(
        default_factory=list, description="RPC workers it was to use that were gone at load: it runs without them"
    )


class PromptCacheSession(_Model):
    """The conversation part of a prompt-cache file (`/save chat.kv` in `localllm run`); the cached state follows it
    in the file."""

    model: str
    system: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    messages: list[Message] = Field(default_factory=list)
    format: Format = None


class PlanRequest(_Model):
    """POST /api/plan: the memory a load of `model` with these load options would take, before anything loads."""

    model: str
    options: dict[str, Any] | None = Field(None, description="load options (num_ctx, num_parallel, kv_type, ...)")


class PlanDevice(_Model):
    """One device's share of a planned load, in bytes, against its free memory now."""

    device: str
    description: str = ""
    kind: str
    layers: int
    weights: int
    kv: int
    compute: int
    total: int
    free: int
    usable: int  # free memory less the loader's margin
    fits: bool


class PlanPlacement(_Model):
    n_gpu_layers: int
    fits: bool
    devices: list[PlanDevice]


class PlanModel(_Model):
    """One model's planned memory (the model's, or its draft model's row), in bytes."""

    model: str
    weights: int
    adapters: int
    projector: int
    kv_per_token: int
    kv_per_slot: int
    kv_total: int
    kv_cells: int
    compute: int
    num_ctx: int
    num_parallel: int
    kv_type: str
    available: int | None
    kv_pooled: bool = Field(True, description="the slots share one KV pool; false: a cache per slot (MLX)")
    input_weights: int = 0
    output_weights: int = 0
    output_tied: bool = False
    total: int
    fits: bool | None
    shares_weights: bool = False  # its weights are a model's above it: counted once in the response's total
    cache_ram_limit: int
    cache_disk_limit: int
    placement: PlanPlacement | None = None


class PlanResponse(_Model):
    models: list[PlanModel]
    total: int  # all rows together, shared weights counted once
    available: int | None  # memory the OS reports as available now, where it can tell
    fits: bool | None


class ProcessResponse(_Model):
    models: list[ProcessModel]
    load_queue: int = Field(
        0, description="requests waiting for a model to load, reload or make room (at most LOCALLLM_LOAD_TIMEOUT)"
    )


# The Ollama release whose API /api/version claims: clients gate features on it (`codex --oss` wants 0.13.4 or
# newer), as they would against Ollama itself. localllm's own version goes beside it.
OLLAMA_API_VERSION = "0.13.5"


class VersionResponse(_Model):
    version: str  # the Ollama API version served
    localllm: str | None = None  # this server's own version


class ErrorBody(_Model):
    error: str


class PruneReport(_Model):
    """What `localllm prune` removed (or would remove, with dry_run): paths relative to the store root."""

    removed: list[str] = Field(default_factory=list)
    freed: int = 0
    dry_run: bool = False


# ---------------------------------------------------------------------------------------------------------- agent APIs


class StoredResponse(_Model):
    """A /v1/responses answer kept for GET and previous_response_id: the response object as sent, and the whole
    conversation it ended (earlier turns, this turn's input, the answer), from which the next turn continues."""

    response: dict[str, Any]
    messages: list[Message] = Field(default_factory=list)
    input_items: list[dict[str, Any]] = Field(default_factory=list, description="this turn's input, for input_items")
