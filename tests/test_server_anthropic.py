"""Anthropic's Messages API, driven by the official `anthropic` package against the real server and model."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from server_harness import PINNED, SYSTEM, env, local_client, pinned_server, serve_in_thread

from localllm import api
from localllm.client.http import HttpClient
from localllm.server.app import create_app

pytestmark = pytest.mark.models

MODEL = PINNED  # these tests compare answers between requests: speculation off, one thread
CATALOG = "smollm2:135m"  # for the servers on the shared home, which has no PINNED


@pytest.fixture(scope="module")
def base_url(models_home, tmp_path_factory):
    target = tmp_path_factory.mktemp("anthropic")
    with pinned_server(models_home, target, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2") as url:
        yield url


# The anthropic package no longer sends sampling fields; the API (and we) still take them.
GREEDY = {"temperature": 0}
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def claude(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) pairs of a server-sent event stream."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == name  # Anthropic names each event after its data's type
            events.append((name, data))
    return events


def test_message_plain(claude):
    reply = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=PARIS, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"] and "Paris" in reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0


def test_system_blocks_with_cache_control_and_cache_read(claude):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Name a fruit.", "cache_control": {"type": "ephemeral"}}]}
    ]
    first = claude.messages.create(model=MODEL, max_tokens=8, system=system, messages=messages, extra_body=GREEDY)
    again = claude.messages.create(
        model=MODEL, max_tokens=8, system=system, messages=messages, metadata={"user_id": "someone"}, extra_body=GREEDY
    )
    assert again.content[0].text == first.content[0].text
    # The second prompt is served from the prefix cache: Anthropic counts those tokens apart from input_tokens.
    assert again.usage.cache_read_input_tokens > 0
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_streamed_text_matches_and_events_in_order(claude, base_url):
    whole = claude.messages.create(model=MODEL, max_tokens=24, messages=PARIS, extra_body=GREEDY)
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=PARIS, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == whole.stop_reason

    body = {"model": MODEL, "max_tokens": 24, "messages": PARIS, "temperature": 0, "stream": True}
    with httpx.stream("POST", base_url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert all(
        data["delta"]["type"] == "text_delta" and data["index"] == 0
        for name, data in events
        if name == "content_block_delta"
    )
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use(claude, choice):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = claude.messages.create(
        model=MODEL, max_tokens=60, messages=messages, tools=[WEATHER], tool_choice=choice, extra_body=GREEDY
    )
    assert reply.stop_reason == "tool_use"
    call = reply.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # The result goes back as a tool_result block naming the call; the model answers in text.
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}
            ],
        },
    ]
    second = claude.messages.create(
        model=MODEL, max_tokens=30, messages=messages, tools=[WEATHER], tool_choice={"type": "none"}, extra_body=GREEDY
    )
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    assert second.content[0].text.strip()


def test_forced_tool_use_streams_input_json(claude):
    with claude.messages.stream(
        model=MODEL,
        max_tokens=60,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        extra_body=GREEDY,
    ) as stream:
        partial = "".join(event.partial_json for event in stream if event.type == "input_json")
        final = stream.get_final_message()
    call = final.content[-1]
    assert call.type == "tool_use" and json.loads(partial) == call.input and "city" in call.input
    assert final.stop_reason == "tool_use"


def test_structured_output(claude):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 24}},
    }
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=PARIS,
        extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_count_tokens(claude, base_url):
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=PARIS)
    reply = claude.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=PARIS, extra_body=GREEDY)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    ours = [api.Message(role="system", content=SYSTEM), api.Message(**PARIS[0])]
    with HttpClient(base_url) as http:  # the same count through the Client interface
        assert http.count_tokens(api.ChatRequest(model=MODEL, messages=ours)) == counted.input_tokens
    with_tools = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=PARIS, tools=[WEATHER])
    assert with_tools.input_tokens >= counted.input_tokens


def test_count_tokens_refuses_a_stream_that_is_not_a_boolean(base_url):
    body = {"model": MODEL, "messages": PARIS}
    for stream in (None, "x"):
        refused = httpx.post(base_url + "/v1/messages/count_tokens", json=body | {"stream": stream}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"].startswith("stream: "), refused.text
    counted = httpx.post(base_url + "/v1/messages/count_tokens", json=body | {"stream": True}, timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text
    assert "stream" in counted.headers["x-localllm-ignored"]


def test_stop_sequence_and_max_tokens(claude):
    stopped = claude.messages.create(
        model=MODEL, max_tokens=40, messages=PARIS, extra_body=GREEDY, stop_sequences=["."]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "."
    assert "." not in stopped.content[0].text
    cut = claude.messages.create(model=MODEL, max_tokens=2, messages=PARIS, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_thinking_on_a_model_that_cannot_think(claude):
    # Claude Code asks for thinking whatever the model: the answer comes without it, and a header says so.
    raw = claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=8, messages=PARIS, thinking={"type": "enabled", "budget_tokens": 4}, extra_body=GREEDY
    )
    assert [block.type for block in raw.parse().content] == ["text"]
    assert "no thinking capability" in raw.headers["x-localllm-ignored"]
    off = claude.messages.create(model=MODEL, max_tokens=4, messages=PARIS, thinking={"type": "disabled"})
    assert off.content[0].type == "text"


def test_errors_in_anthropic_shape(claude, base_url):
    with pytest.raises(anthropic.NotFoundError, match="pull") as caught:
        claude.messages.create(model="nothing-here:1b", max_tokens=4, messages=PARIS)
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": caught.value.body["error"]["message"]},
    }
    image = [
        {
            "role": "user",
            "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}],
        }
    ]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=image)
    # Anthropic's words, which Claude Code matches to compact the conversation
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 1024 maximum"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "word " * 3000}])
    missing = httpx.post(base_url + "/v1/messages", json={"model": MODEL, "messages": PARIS})
    assert missing.status_code == 400 and missing.json()["type"] == "error"
    assert missing.json()["error"]["message"] == "max_tokens: Field required"  # as Anthropic words it
    wrong_role = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}
    refused = httpx.post(base_url + "/v1/messages", json=wrong_role).json()["error"]["message"]
    assert refused.startswith("messages.0.role: Input should be"), refused


def test_a_system_message_inside_messages_is_accepted(claude):
    turns = [
        PARIS[0],
        {"role": "assistant", "content": "Paris."},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "And of Italy?"},
    ]
    reply = claude.messages.create(model=MODEL, max_tokens=4, messages=turns, extra_body=GREEDY)  # type: ignore[arg-type]
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].text
    streamed = claude.messages.create(model=MODEL, max_tokens=4, messages=turns, stream=True)  # type: ignore[arg-type]
    assert "message_stop" in [event.type for event in streamed]


def test_api_key_as_x_api_key_or_bearer(models_home):
    with env(LOCALLLM_API_KEY="sekret", LOCALLLM_CONTEXT_LENGTH="512", LOCALLLM_NUM_PARALLEL="1"):
        client = local_client(models_home)
        try:
            with serve_in_thread(create_app(client)) as url:
                keyed = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0)  # sends x-api-key
                assert keyed.messages.count_tokens(model=CATALOG, messages=PARIS).input_tokens > 0
                bearer = anthropic.Anthropic(base_url=url, auth_token="sekret", max_retries=0)
                assert bearer.messages.count_tokens(model=CATALOG, messages=PARIS).input_tokens > 0
                wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
                with pytest.raises(anthropic.AuthenticationError) as caught:
                    wrong.messages.count_tokens(model=CATALOG, messages=PARIS)
                assert caught.value.body["error"]["type"] == "authentication_error"
        finally:
            client.close()
