"""The OpenAI-compatible API, driven by the official `openai` package against the real server and model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import SYSTEM

pytestmark = pytest.mark.models

MODEL = "smollm2:135m"
PARIS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def base_url(models_home):
    """Deterministic mode for every request: these tests compare the answers of requests sent one after another
    (streamed and not), which the prefill path, speculation and the thread count would otherwise make differ."""
    from server_harness import served

    with served(
        models_home, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2", LOCALLLM_DETERMINISTIC="on"
    ) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="not-needed", max_retries=0)


def test_chat_non_streaming(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.id.startswith("chatcmpl-") and reply.model == MODEL


def test_chat_streaming_with_usage(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=24)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=PARIS,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_tokens=60
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'},
    ]
    second = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_tokens=30
    )
    assert second.choices[0].message.content.strip()
    assert not second.choices[0].message.tool_calls


def test_forced_tool_call_streams(oai):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # As OpenAI streams a call: id and name first, then the arguments in pieces (what partial-object clients read).
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = json.loads("".join(d.function.arguments for d in deltas))
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_tool_call_cut_off_by_max_tokens_says_length_and_is_no_call(oai):
    forced = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=28,
    )
    whole = oai.chat.completions.create(**forced).choices[0]
    # One rule on every route (tests/test_tool_calls.py): the reason says the cut; a partial call is not a call.
    assert whole.finish_reason == "length" and not whole.message.tool_calls and not whole.message.content
    chunks = list(oai.chat.completions.create(**forced, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # A stream has sent the call's pieces before the cut: they stay partial JSON, and the stream ends in `length`.
    assert deltas[0].function.name == "get_weather"
    # The grammar allows whitespace before the object: which one the model takes depends on the machine's numerics.
    arguments = "".join(d.function.arguments for d in deltas)
    assert arguments.lstrip().startswith("{")
    with pytest.raises(ValueError):
        json.loads(arguments)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_json_schema_answer_validates(oai):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}},
    }
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    loose = oai.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=60, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_stop_string_ends_the_answer_without_showing_it(oai):
    stopped = oai.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=40, stop=["."])
    assert "." not in stopped.choices[0].message.content


def test_a_seed_repeats_a_sampled_answer(oai):
    same = [
        oai.chat.completions.create(model=MODEL, messages=PARIS, temperature=1.0, seed=7, max_tokens=16)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert same[0] == same[1]


def test_ignore_eos_runs_to_max_tokens(oai):
    hi = [{"role": "user", "content": "Say hi"}]
    natural = oai.chat.completions.create(model=MODEL, messages=hi, temperature=0, max_tokens=40)
    assert natural.choices[0].finish_reason == "stop"  # ends early by itself...
    forced = oai.chat.completions.create(
        model=MODEL, messages=hi, temperature=0, max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 40  # ...unless told


def test_logprobs(oai):
    reply = oai.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    # greedy: the chosen token is the most likely one
    assert all(entry.top_logprobs[0].token == entry.token for entry in content)


def test_completions(oai):
    whole = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    parts = list(
        oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True)
    )
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"
    with_lp = oai.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, logprobs=1)
    assert len(with_lp.choices[0].logprobs.tokens) == 4


def test_models_and_embeddings(oai, base_url):
    ids = [m.id for m in oai.models.list().data]
    assert MODEL in ids and oai.models.retrieve(MODEL).id == MODEL
    packed = oai.embeddings.create(model=MODEL, input=["hello", "world"])  # the package asks for base64
    plain = oai.embeddings.create(model=MODEL, input=["hello", "world"], encoding_format="float")
    assert len(packed.data) == 2 and packed.usage.prompt_tokens > 0
    assert packed.data[0].embedding == pytest.approx(plain.data[0].embedding, abs=1e-5)
    ollama_vector = httpx.post(base_url + "/api/embed", json={"model": MODEL, "input": "hello"}).json()
    assert plain.data[0].embedding == pytest.approx(ollama_vector["embeddings"][0], abs=1e-5)


IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}},
        ],
    }
]

# (request, error class, text in the message, OpenAI's code). litellm maps a too-long prompt to
# ContextWindowExceededError from its code alone.
ERRORS = {
    "unknown model": ({"model": "nothing-here:1b", "messages": PARIS}, openai.NotFoundError, "pull", "model_not_found"),
    # A model without a vision projector (tests/test_vision.py serves one with a projector).
    "image part": (
        {"model": MODEL, "messages": IMAGE},
        openai.BadRequestError,
        "missing data required for image input",
        "invalid_request_error",
    ),
    "prompt too long": (
        {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}], "stream": True},
        openai.BadRequestError,
        "1024",
        "context_length_exceeded",
    ),
    "no messages": ({"model": MODEL, "messages": []}, openai.BadRequestError, "messages", "invalid_request_error"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(oai, case):
    request, error, text, code = ERRORS[case]
    with pytest.raises(error, match=text) as raised:
        oai.chat.completions.create(**request)
    assert raised.value.code == code and raised.value.type == "invalid_request_error"
