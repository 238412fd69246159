"""OpenAI's request bodies and their translation into our api requests.

These wire types live here rather than in api.py because only the OpenAI routes speak them (Ollama keeps its OpenAI
layer apart from api/types.go the same way). Everything that is not expressible is a 400 naming the field, never
silently dropped: n > 1, image parts, token-array prompts."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .. import api
from ..errors import InvalidInput
from ..thinking import think_from_effort


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Wire):
    include_usage: bool = False


class _Sampling(_Wire):
    """Fields chat and completions share."""

    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token (llama.cpp extension)")
    keep_alive: Union[str, int, float, None] = Field(None, description="Ollama's keep_alive (extension)")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[api.Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    reasoning_effort: Optional[str] = Field(None, description="none, minimal, low, medium or high")
    reasoning: Optional[dict[str, Any]] = Field(None, description="{\"effort\": ...}, as some clients send it")

    @property
    def think(self) -> Union[bool, str, None]:
        if self.reasoning_effort is not None:
            return think_from_effort(self.reasoning_effort)
        return think_from_effort((self.reasoning or {}).get("effort"), field_name="reasoning.effort")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)  # OpenAI's documented default for completions
    suffix: Optional[str] = None
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)


class EmbeddingRequest(_Wire):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None


# ---------------------------------------------------------------------------------------------------------- options

def sampling_options(body: _Sampling, max_tokens: Optional[int]) -> dict[str, Any]:
    """OpenAI's sampling fields as our flat options; unset fields leave the Modelfile's values in force."""
    if body.n != 1:
        raise InvalidInput(f"n={body.n} is not supported: localllm returns one choice per request",
                           hint="send n separate requests (with different seeds)")
    options: dict[str, Any] = {
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
        "num_predict": max_tokens, "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
        "logit_bias": _logit_bias(body.logit_bias), "ignore_eos": body.ignore_eos or None,
    }
    return {name: value for name, value in options.items() if value is not None}


def _logit_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidInput(f"logit_bias keys must be token ids, got {list(bias)!r}") from None


def response_format(fmt: Optional[dict[str, Any]]) -> api.Format:
    """{"type": "json_object"} → "json"; {"type": "json_schema", "json_schema": {"schema": ...}} → the schema."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")  # type: ignore[union-attr]
        if not isinstance(schema, dict):
            raise InvalidInput("response_format.json_schema.schema must be a JSON schema object")
        return schema
    raise InvalidInput(f"response_format.type {kind!r} is not valid", hint="use text, json_object or json_schema")


# ---------------------------------------------------------------------------------------------------------- chat

def chat_request(body: ChatCompletionRequest) -> api.ChatRequest:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return api.ChatRequest(
        model=body.model, messages=chat_messages(body.messages), stream=body.stream,
        options=sampling_options(body, max_tokens), format=response_format(body.response_format),
        tools=body.tools, tool_choice=body.tool_choice, keep_alive=body.keep_alive,
        logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0, think=body.think)


def chat_messages(messages: list[ChatMessage]) -> list[api.Message]:
    """OpenAI messages as ours. A tool result names its call by id; we name the tool, found from that id."""
    tool_names: dict[str, str] = {}
    out = []
    for i, message in enumerate(messages):
        calls = [_tool_call(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(message.tool_calls or [])]
        tool_names.update({c.id: c.function.name for c in calls if c.id})
        role = "system" if message.role == "developer" else message.role
        out.append(api.Message(role=role, content=message_text(message.content, f"messages.{i}.content"),
                               tool_calls=calls or None,
                               tool_name=tool_names.get(message.tool_call_id or "") or message.name))
    return out


def message_text(content: Union[str, list[dict[str, Any]], None], where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise InvalidInput(f"{where}: content parts of type {part.get('type')!r} are not supported",
                               hint="send text only; no vision model backend exists in localllm yet")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _tool_call(call: dict[str, Any], where: str) -> api.ToolCall:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise InvalidInput(f"{where}.function.arguments is not valid JSON: {arguments[:80]!r}") from None
    return api.ToolCall(id=call.get("id"), function=api.ToolCallFunction(name=function.get("name", ""),
                                                                         arguments=arguments))


# ---------------------------------------------------------------------------------------------------------- completions

def completion_request(body: CompletionRequest) -> api.GenerateRequest:
    """A completion is raw text continuation: no chat template, as with OpenAI and llama-server."""
    if body.echo:
        raise InvalidInput("echo is not supported", hint="prepend the prompt to the answer yourself")
    return api.GenerateRequest(
        model=body.model, prompt=completion_prompt(body.prompt), raw=True, stream=body.stream,
        options=sampling_options(body, body.max_tokens), keep_alive=body.keep_alive, suffix=body.suffix,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)


def completion_prompt(prompt: Union[str, list[str], list[int], list[list[int]]]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if all(isinstance(p, str) for p in prompt):
        raise InvalidInput(f"prompt holds {len(prompt)} prompts; localllm completes one per request",
                           hint="send one request per prompt")
    raise InvalidInput("prompt as token ids is not supported", hint="send the prompt as text")


def embed_request(body: EmbeddingRequest) -> api.EmbedRequest:
    if body.input and not all(isinstance(i, str) for i in ([body.input] if isinstance(body.input, str)
                                                           else body.input)):
        raise InvalidInput("input as token ids is not supported", hint="send the input as text")
    if body.dimensions is not None:
        raise InvalidInput("dimensions is not supported: the model's embedding size is fixed")
    return api.EmbedRequest(model=body.model, input=body.input, truncate=False)
