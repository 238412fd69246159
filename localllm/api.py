"""Every wire and user-facing type, shared by the CLI, the TUI, the REST server and the Modelfile front end.

Field names follow Ollama's API (api/types.go) so the same JSON flows through every surface. Options are split by
lifetime: LoadOptions need a reload of the model, SamplingOptions apply per request. `split_options` turns Ollama's
flat `options` object into the two."""

from __future__ import annotations

import difflib
from datetime import datetime, timezone
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidInput


def now() -> datetime:
    return datetime.now(timezone.utc)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, protected_namespaces=())


# ---------------------------------------------------------------------------------------------------------- options

SpecType = Literal["auto", "none", "ngram", "draft", "mtp"]
BackendName = Literal["auto", "llama.cpp", "mlx"]
KVType = Literal["f16", "q8_0", "q4_0"]


class LoadOptions(_Model):
    """Options fixed when a model is loaded; changing any of them reloads the model."""

    num_ctx: Optional[int] = Field(None, ge=16, description="context per slot, in tokens (never divided across slots)")
    num_parallel: Optional[int] = Field(None, ge=1, le=256, description="slots: requests decoded at once")
    num_batch: int = Field(512, ge=1, description="most tokens decoded in one step")
    num_gpu: Optional[int] = Field(None, ge=-1, description="layers offloaded to the GPU; default all that fit")
    num_thread: Optional[int] = Field(None, ge=1, description="CPU threads for decoding")
    flash_attn: Optional[bool] = Field(None, description="flash attention where the backend has it")
    kv_type: Optional[KVType] = Field(None, description="KV cache element type")
    use_mmap: bool = Field(True, description="map the weights file instead of reading it")
    backend: BackendName = Field("auto", description="auto picks mlx for MLX folders, llama.cpp for GGUF")
    draft: Optional[str] = Field(None, description="draft model for speculative decoding (Modelfile DRAFT)")
    embedding: bool = Field(False, description="load for embeddings (pooled output)")
    rpc: Optional[str] = Field(None, max_length=1024, description="RPC workers (`localllm worker`) to place layers "
                               "on, host:port[,host:port...]; default LOCALLLM_RPC, \"\" for none")

    @field_validator("rpc")
    @classmethod
    def _workers(cls, value: Optional[str]) -> Optional[str]:
        from .config import parse_endpoints

        return None if value is None else ",".join(parse_endpoints(value))  # ValueError names the bad one


class SamplingOptions(_Model):
    """Options that apply to one request."""

    temperature: float = Field(0.8, ge=0.0, description="0 is greedy")
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.9, ge=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, ge=0.0)
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = Field(default_factory=list)
    num_predict: int = Field(-1, ge=-2, description="most tokens to generate; -1 until the context is full")
    logit_bias: dict[int, float] = Field(default_factory=dict)
    ignore_eos: bool = False
    spec_type: SpecType = Field("auto", description="speculative decoding: auto, none, ngram, draft, mtp")
    spec_max_draft: int = Field(32, ge=0, le=64, description="most draft tokens verified per step (the draft window "
                                "sizes each draft below this from its acceptance and cost)")


LOAD_OPTION_NAMES = frozenset(LoadOptions.model_fields)
SAMPLING_OPTION_NAMES = frozenset(SamplingOptions.model_fields)
# Ollama options we accept and ignore because they have no meaning here (documented for users who copy Modelfiles).
IGNORED_OPTION_NAMES = frozenset({"num_keep", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline",
                                  "numa", "main_gpu", "low_vram", "vocab_only", "use_mlock", "tfs_z", "num_gqa"})


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
            raise InvalidInput(f"unknown option {name!r}",
                               hint="see `localllm show MODEL --parameters` or Ollama's list of Modelfile parameters")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    return load, sampling


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
    id: Optional[str] = None


class Message(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: Optional[str] = None
    images: Optional[list[str]] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_name: Optional[str] = None


class ToolFunction(_Model):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class Tool(_Model):
    type: Literal["function"] = "function"
    function: ToolFunction


Format = Union[Literal["json", ""], dict[str, Any], None]


# ---------------------------------------------------------------------------------------------------------- requests

class _InferenceRequest(_Model):
    model: str
    format: Format = None
    options: dict[str, Any] = Field(default_factory=dict)
    stream: bool = True
    keep_alive: Union[str, int, float, None] = None
    think: Union[bool, str, None] = None
    truncate: bool = Field(False, description="drop the oldest prompt tokens on overflow instead of failing")
    logprobs: bool = Field(False, description="return each generated token's log-probability")
    top_logprobs: int = Field(0, ge=0, le=20, description="and this many most likely alternatives per token")


class GenerateRequest(_InferenceRequest):
    prompt: str = ""
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    raw: bool = False
    images: Optional[list[str]] = None
    context: Optional[list[int]] = None


class ChatRequest(_InferenceRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = Field(None, description="auto, none, required or a function")


class EmbedRequest(_Model):
    model: str
    input: Union[str, list[str]]
    truncate: bool = True
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: Union[str, int, float, None] = None


class EmbedResponse(_Model):
    model: str
    embeddings: list[list[float]]
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0


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


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


DoneReason = Literal["stop", "length", "cancelled", "load", "unload", "error"]


class GenerateChunk(Timings):
    model: str
    created_at: datetime = Field(default_factory=now)
    response: str = ""
    thinking: Optional[str] = None
    done: bool = False
    done_reason: Optional[DoneReason] = None
    context: Optional[list[int]] = None
    tokens: Optional[list[int]] = Field(None, description="token ids in this chunk (localllm extension)")
    logprobs: Optional[list[TokenLogprob]] = None


class ChatChunk(Timings):
    model: str
    created_at: datetime = Field(default_factory=now)
    message: Message = Field(default_factory=lambda: Message(role="assistant"))
    done: bool = False
    done_reason: Optional[DoneReason] = None
    tokens: Optional[list[int]] = Field(None, description="token ids in this chunk (localllm extension)")
    logprobs: Optional[list[TokenLogprob]] = None


# ---------------------------------------------------------------------------------------------------------- models

class ModelDetails(_Model):
    parent_model: str = ""
    format: str = "gguf"
    family: str = ""
    families: Optional[list[str]] = None
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


class ShowRequest(_Model):
    model: str
    verbose: bool = False


class ShowResponse(_Model):
    license: str = ""
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    system: str = ""
    details: ModelDetails = Field(default_factory=ModelDetails)
    model_info: dict[str, Any] = Field(default_factory=dict)
    capabilities: list[str] = Field(default_factory=list)
    modified_at: Optional[datetime] = None
    path: Optional[str] = Field(None, description="weights file or folder on disk (localllm extension)")
    draft: Optional[str] = None


class PullRequest(_Model):
    model: str
    insecure: bool = False
    stream: bool = True


class PullProgress(_Model):
    """One value of a pull's progress stream, shared by the CLI bar and /api/pull."""

    status: str
    digest: Optional[str] = None
    total: Optional[int] = None
    completed: Optional[int] = None


class CreateRequest(_Model):
    """What a Modelfile says, and what /api/create accepts."""

    model: str
    from_: Optional[str] = Field(None, alias="from")
    modelfile: Optional[str] = None
    template: Optional[str] = None
    system: Optional[str] = None
    license: Union[str, list[str], None] = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    messages: list[Message] = Field(default_factory=list)
    adapters: dict[str, str] = Field(default_factory=dict)
    draft: Optional[str] = None
    quantize: Optional[str] = None
    format: Optional[Literal["gguf", "mlx"]] = None
    stream: bool = True


class CopyRequest(_Model):
    source: str
    destination: str


class DeleteRequest(_Model):
    model: str


class DeviceLayers(_Model):
    """Where part of a loaded model runs: a device (CPU, CUDA0, RPC0) and the layers it holds."""

    device: str
    description: str = ""
    layers: int = 0  # repeating layers, plus one for the output head
    memory: int = 0  # bytes placed there: weights, KV cache, compute buffer (estimate)


class ProcessModel(_Model):
    """One row of `localllm ps` and /api/ps."""

    name: str
    model: str
    size: int = 0
    digest: str = ""
    details: ModelDetails = Field(default_factory=ModelDetails)
    expires_at: Optional[datetime] = None
    size_vram: int = 0
    context_length: int = 0
    backend: str = "llama.cpp"
    slots_busy: int = 0
    slots_total: int = 0
    queue_depth: int = 0
    kv_type: str = "f16"
    gpu_layers: int = 0
    speculation: str = "none"
    draft_count: int = 0
    draft_accepted: int = 0
    status: Optional[str] = None  # "removed": its model was deleted; it unloads when its running requests end
    placement: list[DeviceLayers] = Field(default_factory=list)  # where its layers run; empty where unknown


class ProcessResponse(_Model):
    models: list[ProcessModel]


class VersionResponse(_Model):
    version: str


class ErrorBody(_Model):
    error: str


class PruneReport(_Model):
    """What `localllm prune` removed (or would remove, with dry_run): paths relative to the store root."""

    removed: list[str] = Field(default_factory=list)
    freed: int = 0
    dry_run: bool = False
