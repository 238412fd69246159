"""OpenAI's request bodies and their translation into our api requests.

These wire types live here rather than in api.py because only the OpenAI routes speak them (Ollama keeps its OpenAI
layer apart from api/types.go the same way). Everything that is not expressible is a 400 naming the field, never
silently dropped (echo with logprobs). Image parts are `data:` URIs (a remote URL is refused: the server never fetches
one); a message's images go before its text. `n` choices and prompt lists become several api requests, run
as one batch."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ... import api
from ...chat.thinking import think_from_effort
from ...errors import InvalidInput
from ...media import data_uri_image
from ..billing_header import without_billing_header


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Wire):
    include_usage: bool = False


class _Sampling(_Wire):
    """Fields chat and completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)  # OpenAI's minimum: 0 is a 400, never "no limit"
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128, description="choices per prompt")
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token (llama.cpp extension)")
    keep_alive: api.Duration | None = Field(None, description="Ollama's keep_alive (extension)")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=api.MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    tools: list[api.Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = Field(None, description="none, minimal, low, medium or high")
    reasoning: dict[str, Any] | None = Field(None, description='{"effort": ...}, as some clients send it')

    @property
    def think(self) -> bool | str | None:
        if self.reasoning_effort is not None:
            return think_from_effort(self.reasoning_effort)
        return think_from_effort((self.reasoning or {}).get("effort"), field_name="reasoning.effort")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's documented default for completions
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)


class EmbeddingRequest(_Wire):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


# ---------------------------------------------------------------------------------------------------------- options


def sampling_options(body: _Sampling, max_tokens: int | None) -> dict[str, Any]:
    """OpenAI's sampling fields as our flat options; unset fields leave the Modelfile's values in force."""
    options: dict[str, Any] = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "num_predict": max_tokens,
        "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
        "logit_bias": _logit_bias(body.logit_bias),
        "ignore_eos": body.ignore_eos or None,
    }
    return {name: value for name, value in options.items() if value is not None}


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidInput(f"logit_bias keys must be token ids, got {list(bias)!r}") from None


def response_format(fmt: dict[str, Any] | None) -> api.Format:
    """{"type": "json_object"} → "json"; {"type": "json_schema", "json_schema": {"schema": ...}} → the schema."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = fmt.get("json_schema")  # type: ignore[union-attr]
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidInput("response_format.json_schema.schema must be a JSON schema object")
        return schema
    raise InvalidInput(f"response_format.type {kind!r} is not valid", hint="use text, json_object or json_schema")


# ---------------------------------------------------------------------------------------------------------- chat


def chat_requests(body: ChatCompletionRequest) -> list[api.ChatRequest]:
    """One api request per choice (`n`); with a seed, choice i samples with seed + i so the choices differ."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = api.ChatRequest(
        model=body.model,
        messages=without_billing_header(chat_messages(body.messages)),  # Claude Code through a proxy
        stream=body.stream,
        options=sampling_options(body, max_tokens),
        format=response_format(body.response_format),
        tools=body.tools,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        keep_alive=body.keep_alive,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        think=body.think,
    )
    return [_choice(request, body.seed, i) for i in range(body.n)]


def _choice(request: Any, seed: int | None, index: int) -> Any:
    if seed is None or index == 0:
        return request
    return request.model_copy(update={"options": {**request.options, "seed": seed + index}})


def chat_messages(messages: list[ChatMessage]) -> list[api.Message]:
    """OpenAI messages as ours. A tool result names its call by id; we name the tool, found from that id."""
    tool_names: dict[str, str] = {}
    out = []
    for i, message in enumerate(messages):
        calls = [_tool_call(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(message.tool_calls or [])]
        tool_names.update({c.id: c.function.name for c in calls if c.id})
        role = "system" if message.role == "developer" else message.role
        out.append(
            api.Message(
                role=role,
                content=message_text(message.content, f"messages.{i}.content"),
                images=message_images(message.content, f"messages.{i}.content") or None,
                tool_calls=calls or None,
                tool_name=tool_names.get(message.tool_call_id or "") or message.name,
            )
        )
    return out


def message_text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """The text parts of a message's content, joined (image parts are message_images')."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("text", "image_url"):
            raise InvalidInput(
                f"{where}.{j}: content parts of type {part.get('type')!r} are not supported",
                hint="send text and image_url parts",
            )
        if part.get("type") == "text":
            texts.append(str(part.get("text", "")))
    return "".join(texts)


def message_images(content: str | list[dict[str, Any]] | None, where: str) -> list[str]:
    """The base64 images of a message's image_url parts (data: URIs only), in order; they go before its text."""
    if content is None or isinstance(content, str):
        return []
    images = []
    for j, part in enumerate(content):
        if part.get("type") == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str):
                raise InvalidInput(f"{where}.{j}.image_url.url must be a string")
            images.append(data_uri_image(url, where=f"{where}.{j}.image_url.url"))
    return images


def _tool_call(call: dict[str, Any], where: str) -> api.ToolCall:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise InvalidInput(f"{where}.function.arguments is not valid JSON: {arguments[:80]!r}") from None
    return api.ToolCall(
        id=call.get("id"), function=api.ToolCallFunction(name=function.get("name", ""), arguments=arguments)
    )


# ---------------------------------------------------------------------------------------------------------- completions


def completion_requests(body: CompletionRequest) -> tuple[list[api.GenerateRequest], list[str] | None]:
    """One api request per prompt and choice (OpenAI orders them prompt by prompt, n each), and the text each
    choice echoes (`echo`), or None. A completion is raw text continuation: no chat template, as with OpenAI and
    llama-server; a token-id prompt goes to the engine as it is."""
    if body.echo and body.logprobs is not None:
        raise InvalidInput("echo with logprobs is not supported", hint="drop one of them")
    prompts = completion_prompts(body.prompt)
    if body.echo and any(not isinstance(p, str) for p in prompts):
        raise InvalidInput("echo needs a text prompt, not token ids", hint="send the prompt as text")
    requests, echoes = [], []
    for prompt in prompts:
        text, tokens = (prompt, None) if isinstance(prompt, str) else ("", prompt)
        request = api.GenerateRequest(
            model=body.model,
            prompt=text,
            context=tokens,
            raw=True,
            stream=body.stream,
            options=sampling_options(body, body.max_tokens),
            keep_alive=body.keep_alive,
            suffix=body.suffix,
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0,
        )
        requests += [_choice(request, body.seed, i) for i in range(body.n)]
        echoes += [text] * body.n
    return requests, echoes if body.echo else None


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """`prompt` as a list of prompts: text, or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidInput("prompt is an empty list", hint="send a prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    for i, p in enumerate(prompt):
        if isinstance(p, list) and not p:
            raise InvalidInput(f"prompt {i} is an empty list of tokens")
    return list(prompt)  # type: ignore[arg-type]


def embed_request(body: EmbeddingRequest) -> api.EmbedRequest:
    """Text or token-id input (langchain-openai sends token ids by default). OpenAI refuses "" and [] with a 400."""
    value = body.input
    if isinstance(value, str):
        value = [value]
    if not value:
        raise InvalidInput("input is an empty list", hint="send at least one text or token list")
    if all(isinstance(item, int) for item in value):
        return api.EmbedRequest(
            model=body.model, input=[], input_tokens=[list(value)], dimensions=body.dimensions, truncate=False
        )
    for i, item in enumerate(value):
        if not item:
            raise InvalidInput(f"input {i} is empty", hint="embed non-empty texts")
    if all(isinstance(item, str) for item in value):
        return api.EmbedRequest(model=body.model, input=list(value), dimensions=body.dimensions, truncate=False)
    return api.EmbedRequest(
        model=body.model,
        input=[],
        input_tokens=[list(item) for item in value],  # type: ignore
        dimensions=body.dimensions,
        truncate=False,
    )
