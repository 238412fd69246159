"""OpenAI's Responses API, driven by the official `openai` package against the real server and model; the store's
bounds are tested without a model."""

from __future__ import annotations

import json
import os
import time

import httpx
import jsonschema
import openai
import pytest
from server_harness import PINNED, SYSTEM, pinned_server

from localllm import api, config
from localllm.errors import ResponseNotFound
from localllm.server.openai import response_store

MODEL = PINNED  # these tests compare answers between requests: speculation off, one thread


@pytest.fixture(scope="module")
def base_url(models_home, tmp_path_factory):
    target = tmp_path_factory.mktemp("responses")
    with pinned_server(models_home, target, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2") as url:
        yield url


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.models
def test_plain_response_is_stored(oai):
    reply = oai.responses.create(
        model=MODEL, instructions=SYSTEM, input="What is the capital of France?", temperature=0, max_output_tokens=24
    )
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    assert reply.status in ("completed", "incomplete") and "Paris" in reply.output_text
    assert [item.type for item in reply.output] == ["message"] and reply.output[0].role == "assistant"
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    fetched = oai.responses.retrieve(reply.id)
    assert fetched.output_text == reply.output_text and fetched.id == reply.id
    oai.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(reply.id)


@pytest.mark.models
def test_store_false_is_not_kept(oai):
    reply = oai.responses.create(model=MODEL, input="Say hi", store=False, temperature=0, max_output_tokens=4)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        oai.responses.create(model=MODEL, input="and then?", previous_response_id=reply.id)


@pytest.mark.models
def test_previous_response_id_continues_the_conversation(oai):
    fact = "My cat is called Whiskerton."
    first = oai.responses.create(model=MODEL, instructions=SYSTEM, input=fact, temperature=0, max_output_tokens=16)
    second = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="What is my cat called?",
        instructions=SYSTEM,
        temperature=0,
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    # The second prompt holds the first turn (question and answer) before the new input: its first tokens are the
    # first prompt's, found in the prefix cache, and it is longer than the first prompt and answer together.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    stored = response_store.load(second.id)  # instructions belong to their turn and are not stored
    said = [(m.role, m.content) for m in stored.messages]
    assert said == [
        ("user", fact),
        ("assistant", first.output_text),
        ("user", "What is my cat called?"),
        ("assistant", second.output_text),
    ]


@pytest.mark.models
def test_streamed_events_in_openai_order(oai):
    whole = oai.responses.create(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24
    )
    events = list(
        oai.responses.create(
            model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        events[-1].type,
    ]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert final.output[0].id == events[2].item.id and final.usage.output_tokens == whole.usage.output_tokens
    assert oai.responses.retrieve(final.id).output_text == text  # streamed answers are stored too


@pytest.mark.models
def test_forced_function_call_and_its_output(oai):
    first = oai.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    second = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}],
    )
    assert second.output_text.strip() and not [i for i in second.output if i.type == "function_call"]
    roles = [(m.role, m.tool_name) for m in response_store.load(second.id).messages]
    assert roles[-2:] == [("tool", "get_weather"), ("assistant", None)]


@pytest.mark.models
def test_function_call_streams_arguments(oai):
    events = list(
        oai.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=60,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    at = kinds.index("response.function_call_arguments.delta")
    done = kinds.index("response.function_call_arguments.done")
    assert kinds[at - 1] == "response.output_item.added" and events[at - 1].item.type == "function_call"
    # The arguments arrive in pieces as they are generated, and the pieces add up to the whole.
    assert done - at > 1 and set(kinds[at:done]) == {"response.function_call_arguments.delta"}
    assert "".join(e.delta for e in events[at:done]) == events[done].arguments
    assert kinds[done + 1] == "response.output_item.done"
    assert "city" in json.loads(events[done].arguments)


@pytest.mark.models
def test_json_schema_and_input_items(oai):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 24}},
    }
    reply = oai.responses.create(
        model=MODEL,
        temperature=0,
        max_output_tokens=60,
        input=[
            {"role": "developer", "content": SYSTEM},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What is the capital of France?"}],
            },
        ],
        text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.output_text), schema)


@pytest.mark.models
def test_errors(oai, base_url):
    with pytest.raises(openai.NotFoundError, match="pull"):
        oai.responses.create(model="nothing-here:1b", input="hi")
    with pytest.raises(openai.BadRequestError, match="does not support thinking"):
        oai.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})
    with pytest.raises(openai.BadRequestError, match="missing data required for image input"):  # no projector
        oai.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,aGk="}]}],
        )
    assert httpx.get(base_url + "/v1/responses/../../etc").status_code in (400, 404)
    assert httpx.get(base_url + "/v1/responses/resp_nothing").status_code == 400


# ---------------------------------------------------------------------------------------------------------- store


def _stored(number: int) -> api.StoredResponse:
    return api.StoredResponse(
        response={"id": f"resp_{number:032x}", "object": "response"},
        messages=[api.Message(role="user", content=f"turn {number}")],
    )


def test_store_keeps_the_newest_within_count_and_age(monkeypatch):
    monkeypatch.setenv("LOCALLLM_RESPONSES_MAX", "3")
    now = time.time()
    for number in range(5):  # saved a second apart, the newest last
        response_store.save(_stored(number))
        os.utime(config.responses_dir() / f"resp_{number:032x}.json", (now - 5 + number,) * 2)
    response_store.prune(now=now)
    kept = sorted(p.name for p in config.responses_dir().iterdir())
    assert kept == [f"resp_{n:032x}.json" for n in (2, 3, 4)]
    assert response_store.load(f"resp_{4:032x}").messages[0].content == "turn 4"
    monkeypatch.setenv("LOCALLLM_RESPONSES_MAX_AGE", "1.5")
    response_store.prune(now=now)  # 3 is 2 s old, 4 is 1 s old
    assert [p.name for p in config.responses_dir().iterdir()] == [f"resp_{4:032x}.json"]
    with pytest.raises(ResponseNotFound):
        response_store.load(f"resp_{2:032x}")


def test_store_writes_whole_files_and_refuses_odd_ids():
    response_store.save(_stored(7))
    assert [p.name for p in config.responses_dir().iterdir()] == [f"resp_{7:032x}.json"]  # no temporary left
    from localllm.errors import InvalidInput

    for bad in ("../x", "resp_../../etc", "resp_XYZ", ""):
        with pytest.raises(InvalidInput):
            response_store.load(bad)
