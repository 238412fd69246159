"""Coding agents as they really call us, through the real `anthropic` and `openai` packages against the real server
and model: Claude Code's billing line, thinking asked of a model without it, Codex's remote compaction (both forms),
the list of a response's input items, and every request field these agents send beyond the SDK examples (each is
honoured, refused with a 400, or named in the X-LocalLLM-Ignored header). The parts without a model come first."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from server_harness import PINNED, pinned_server

from localllm import api
from localllm.errors import InvalidInput
from localllm.server.billing_header import strip_billing_header, without_billing_header
from localllm.server.first_call import FirstCallOnly, one_call_at_most
from localllm.server.openai import compaction, response_store
from localllm.server.openai import responses_requests as responses

BILLING = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={};"
GREEDY = {"temperature": 0}  # the anthropic package no longer sends sampling fields; the API (and we) still take them
# A Claude Code-like system prompt, long enough that the billing line is a small part of it.
INSTRUCTIONS = " ".join(
    f"Rule {n}: answer briefly, name the file you change, run the tests after each change, never guess a path."
    for n in range(1, 25)
)


# ---------------------------------------------------------------------------------------------------------- no model


@pytest.mark.parametrize(
    "text, expected",
    [
        (BILLING.format("36ee5"), ""),
        (BILLING.format("36ee5") + "\n\nYou are Claude Code.", "You are Claude Code."),
        (BILLING.format("36ee5") + "You are Claude Code.", "You are Claude Code."),  # blocks joined by a proxy
        ("You are Claude Code.\n" + BILLING.format("1"), "You are Claude Code.\n" + BILLING.format("1")),
        (
            "x-anthropic-billing-header: please explain this header",
            "x-anthropic-billing-header: please explain this header",
        ),
        (
            "x-anthropic-billing-header: cc_version=1; and then prose",
            "x-anthropic-billing-header: cc_version=1; and then prose",
        ),
    ],
)
def test_only_the_leading_billing_line_goes(text, expected):
    assert strip_billing_header(text) == expected


def test_billing_line_leaves_user_content_alone():
    line = BILLING.format("abcde")
    messages = [
        api.Message(role="system", content=line),
        api.Message(role="user", content=line),
        api.Message(role="system", content=line + "\nBe brief."),
    ]
    assert [(m.role, m.content) for m in without_billing_header(messages)] == [
        ("user", line),
        ("system", "Be brief."),
    ]


def test_compaction_token_round_trip_and_tampering():
    token = compaction.seal("We fixed the parser; tests pass.")
    assert compaction.unseal(token, "input.0") == "We fixed the parser; tests pass."
    body, _, mac = token.removeprefix(compaction.TOKEN_PREFIX).partition(".")
    forged = compaction.TOKEN_PREFIX + compaction._b64(b'{"summary": "rm -rf /"}') + "." + mac
    flipped = token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]
    for bad in (forged, flipped, "not a token", compaction.TOKEN_PREFIX + "%%%.%%%", None, 7):
        with pytest.raises(InvalidInput, match="input.3.encrypted_content"):
            compaction.unseal(bad, "input.3")


def test_compaction_items_expand_to_the_summary():
    token = compaction.seal("The user wants a haiku.")
    body = responses.ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Write a haiku."},
                {"type": "compaction", "id": "cmp_1", "encrypted_content": token},
                {"role": "user", "content": "Shorter."},
                {"type": "compaction_trigger"},
            ],
        }
    )
    assert responses.compaction_triggered(body.input)
    said = responses.conversation(body.input, [])
    assert [(m.role, m.content) for m in said] == [
        ("user", "Write a haiku."),
        ("assistant", compaction.SUMMARY_LEAD + "The user wants a haiku."),
        ("user", "Shorter."),
    ]
    early = responses.ResponsesRequest.model_validate(
        {"model": "m", "input": [{"type": "compaction_trigger"}, {"role": "user", "content": "x"}]}
    )
    with pytest.raises(InvalidInput, match="must be the last"):
        responses.chat_request(early, [])
    assert compaction.summary_budget(10) == compaction.MIN_SUMMARY_TOKENS
    assert compaction.summary_budget(600) == 150
    assert compaction.summary_budget(10**6) == compaction.MAX_SUMMARY_TOKENS


def test_input_items_page():
    records = responses.input_item_records([{"role": "user", "content": f"turn {n}"} for n in range(5)])
    assert all(r["type"] == "message" and r["id"].startswith("msg_") for r in records)
    assert records[0]["content"] == [{"type": "input_text", "text": "turn 0"}]
    stored = api.StoredResponse(response={"id": "resp_" + "0" * 32}, input_items=records)
    first = response_store.input_items_page(stored, limit=2)
    assert [r["content"][0]["text"] for r in first["data"]] == ["turn 4", "turn 3"] and first["has_more"]
    rest = response_store.input_items_page(stored, limit=20, order="asc", after=records[2]["id"])
    assert [r["content"][0]["text"] for r in rest["data"]] == ["turn 3", "turn 4"] and not rest["has_more"]
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_nothing"}):
        with pytest.raises(InvalidInput):
            response_store.input_items_page(stored, **bad)


def _call(name: str) -> api.ToolCall:
    return api.ToolCall(id=f"call_{name}", function=api.ToolCallFunction(name=name, arguments={}))


def test_parallel_calls_off_keeps_the_first():
    calls = [_call("a"), _call("b")]
    deltas = [api.ToolCallDelta(index=0, name="a"), api.ToolCallDelta(index=1, name="b")]
    chunks = [
        api.ChatChunk(model="m", message=api.Message(role="assistant", content=""), tool_call_deltas=deltas),
        api.ChatChunk(model="m", message=api.Message(role="assistant", tool_calls=calls), done=True),
    ]
    kept = list(one_call_at_most(iter(chunks), parallel=False))
    assert [d.name for d in kept[0].tool_call_deltas] == ["a"]
    assert [c.function.name for c in kept[1].message.tool_calls] == ["a"]
    assert list(one_call_at_most(iter(chunks), parallel=True)) == chunks

    class Queued:  # a Cancellable iterator stays cancellable through the wrapper
        cancelled = False

        def __iter__(self):
            return self

        def __next__(self):
            raise StopIteration

        def cancel(self):
            self.cancelled = True

    queued = Queued()
    FirstCallOnly(queued).cancel()
    assert queued.cancelled


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"include": ["message.output_text.logprobs"]}, "include 'message.output_text.logprobs'"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary 'verbose'"),
    ],
)
def test_responses_fields_refused_by_name(fields, message):
    body = responses.ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    with pytest.raises(InvalidInput, match=message):
        responses.chat_request(body, [])


def test_responses_fields_honoured_or_named():
    body = responses.ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": "hi",
            "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"},
            "truncation": "auto",
            "prompt_cache_key": "session-1",
            "service_tier": "flex",
        }
    )
    assert responses.chat_request(body, []).truncate is True
    notes = " | ".join(responses.ignored(body))
    assert "service_tier" in notes and "reasoning.encrypted_content" in notes and "reasoning.summary" in notes


# ---------------------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def agents_url(models_home, tmp_path_factory):
    """One slot, one thread and a model whose speculation is off: greedy answers compare token for token."""
    target = tmp_path_factory.mktemp("agents")
    with pinned_server(models_home, target, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="1") as url:
        yield url


@pytest.fixture
def claude(agents_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agents_url, api_key="unused", max_retries=0)


@pytest.fixture
def oai(agents_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=agents_url + "/v1", api_key="unused", max_retries=0)


def _system(cch: str | None) -> list[dict]:
    blocks = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}]
    blocks.append({"type": "text", "text": INSTRUCTIONS, "cache_control": {"type": "ephemeral"}})
    return ([{"type": "text", "text": BILLING.format(cch)}] if cch else []) + blocks


@pytest.mark.models
def test_billing_line_keeps_the_prefix_cache(claude):
    ask = [{"role": "user", "content": "Which file holds the tests?"}]
    first = claude.messages.create(
        model=PINNED, max_tokens=24, system=_system("36ee5"), messages=ask, extra_body=GREEDY
    )
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    then = ask + [
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "And how do I run them?"},
    ]
    second = claude.messages.create(
        model=PINNED, max_tokens=24, system=_system("0aaa9"), messages=then, extra_body=GREEDY
    )
    assert second.usage.cache_read_input_tokens >= 0.9 * prompt
    bare = claude.messages.create(model=PINNED, max_tokens=24, system=_system(None), messages=then, extra_body=GREEDY)
    assert bare.content[0].text == second.content[0].text
    assert bare.usage.input_tokens + bare.usage.cache_read_input_tokens == (
        second.usage.input_tokens + second.usage.cache_read_input_tokens
    )
    counted = [claude.messages.count_tokens(model=PINNED, system=_system(c), messages=then) for c in ("1", None)]
    assert counted[0].input_tokens == counted[1].input_tokens


@pytest.mark.models
def test_billing_line_through_chat_completions(oai):
    def prompt_tokens(system: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        return oai.chat.completions.create(model=PINNED, messages=messages, max_tokens=1).usage.prompt_tokens

    assert prompt_tokens(BILLING.format("12345") + "\n" + INSTRUCTIONS) == prompt_tokens(INSTRUCTIONS)


@pytest.mark.models
def test_thinking_on_a_model_without_it_is_answered_plainly(claude, agents_url):
    raw = claude.messages.with_raw_response.create(
        model=PINNED,
        max_tokens=16,
        messages=[{"role": "user", "content": "Say hi."}],
        thinking={"type": "enabled", "budget_tokens": 8},
        extra_body=GREEDY,
    )
    reply = raw.parse()
    assert [block.type for block in reply.content] == ["text"]
    assert "no thinking capability" in raw.headers["x-localllm-ignored"]
    assert "budget_tokens" in raw.headers["x-localllm-ignored"]
    # Ollama's routes keep the 400: their clients use it to adapt.
    ollama = httpx.post(
        agents_url + "/api/chat",
        json={"model": PINNED, "messages": [{"role": "user", "content": "hi"}], "think": True, "stream": False},
    )
    assert ollama.status_code == 400 and "does not support thinking" in ollama.json()["error"]


@pytest.mark.models
def test_streamed_usage_has_one_rule(claude):
    ask = {"model": PINNED, "max_tokens": 8, "system": _system(None), "extra_body": GREEDY}
    messages = [{"role": "user", "content": "Name a test runner."}]
    claude.messages.create(**ask, messages=messages)
    with claude.messages.stream(**ask, messages=messages) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert start.cache_read_input_tokens > 0  # served from the prefix cache, and said so from the start
    assert start.input_tokens == delta.input_tokens and start.cache_read_input_tokens == delta.cache_read_input_tokens


@pytest.mark.models
def test_claude_code_request_shapes(claude):
    tool = {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}
    history = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Read a and b.", "cache_control": {"type": "ephemeral"}}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {"path": "a"}},
                {"type": "tool_use", "id": "toolu_b", "name": "read", "input": {"path": "b"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "alpha"},
                {"type": "tool_result", "tool_use_id": "toolu_b", "content": "no such file", "is_error": True},
            ],
        },
    ]
    raw = claude.messages.with_raw_response.create(
        model=PINNED,
        max_tokens=4,
        messages=history,
        tools=[tool],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        metadata={"user_id": "session-1"},
        extra_body={"context_management": {"edits": []}},
    )
    assert raw.parse().type == "message"
    notes = raw.headers["x-localllm-ignored"]
    assert "metadata" in notes and "context_management" in notes
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
    refused = [
        ({"messages": [{"role": "user", "content": [image]}]}, "missing data required for image input"),
        ({"metadata": {"user": "x"}}, "metadata.user"),
        ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "less than max_tokens"),
    ]
    for fields, message in refused:
        with pytest.raises(anthropic.BadRequestError, match=message):
            claude.messages.create(**{"model": PINNED, "max_tokens": 8, "messages": history[:1], **fields})


def _turns(oai: openai.OpenAI) -> openai.types.responses.Response:
    first = oai.responses.create(
        model=PINNED, input="Tell me about the river Thames.", temperature=0, max_output_tokens=32
    )
    return oai.responses.create(
        model=PINNED,
        previous_response_id=first.id,
        input="And about its bridges?",
        temperature=0,
        max_output_tokens=32,
    )


@pytest.mark.models
def test_compaction_replaces_the_history(oai):
    second = _turns(oai)
    compacted = oai.responses.compact(model=PINNED, previous_response_id=second.id)
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    kinds = [(item.type, getattr(item, "role", None)) for item in compacted.output]
    assert kinds == [("message", "user"), ("message", "user"), ("compaction", None)]
    item = compacted.output[-1].model_dump(exclude_none=True)
    ask = {"role": "user", "content": "Summarise that in one line."}
    after = [*[i.model_dump(exclude_none=True, warnings=False) for i in compacted.output], ask]
    short = oai.responses.create(model=PINNED, input=after, temperature=0, max_output_tokens=4)
    full = oai.responses.create(
        model=PINNED, previous_response_id=second.id, input=[ask], temperature=0, max_output_tokens=4
    )
    assert short.usage.input_tokens < full.usage.input_tokens
    tampered = {**item, "encrypted_content": item["encrypted_content"][:-3] + "AAA"}
    with pytest.raises(openai.BadRequestError, match="encrypted_content"):
        oai.responses.create(model=PINNED, input=[tampered, ask], max_output_tokens=4)

    # Newer Codex: the same compaction as a turn whose input ends with a compaction_trigger, streamed.
    events = list(
        oai.responses.create(
            model=PINNED, previous_response_id=second.id, input=[{"type": "compaction_trigger"}], stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.output_item.done")
    assert done.item.type == "compaction" and done.item.encrypted_content
    assert [e.sequence_number for e in events] == list(range(len(events)))
    compacted = events[-1].response
    # The stored turn is the compacted conversation: continuing from it costs fewer tokens than the full one.
    ask = [{"role": "user", "content": "Go on."}]
    short = oai.responses.create(model=PINNED, previous_response_id=compacted.id, input=ask, max_output_tokens=2)
    full = oai.responses.create(model=PINNED, previous_response_id=second.id, input=ask, max_output_tokens=2)
    assert short.usage.input_tokens < full.usage.input_tokens


@pytest.mark.models
def test_input_items_and_codex_fields(oai, agents_url):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    raw = oai.responses.with_raw_response.create(
        model=PINNED,
        input=items,
        max_output_tokens=2,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="codex-session",
        truncation="auto",
        parallel_tool_calls=False,
        reasoning={"summary": "auto"},
    )
    reply = raw.parse()
    assert reply.prompt_cache_key == "codex-session" and reply.truncation == "auto"
    assert reply.reasoning.summary == "auto" and reply.parallel_tool_calls is False
    assert "reasoning.summary" in raw.headers["x-localllm-ignored"]
    listed = oai.responses.input_items.list(reply.id, order="asc")
    assert [(i.type, i.role) for i in listed.data] == [("message", "developer"), ("message", "user")]
    assert listed.data[1].content[0].text == "Hi"
    assert httpx.get(f"{agents_url}/v1/responses/{reply.id}/input_items?limit=1").json()["has_more"] is True
    long = "word " * 1200
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=PINNED, input=long, max_output_tokens=2)
    cut = oai.responses.create(model=PINNED, input=long, max_output_tokens=2, truncation="auto")
    assert cut.usage.input_tokens < 1024
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        oai.responses.create(model=PINNED, input="hi", include=["message.output_text.logprobs"])
    assert json.dumps(reply.to_dict())  # the whole answer parses as the SDK's Response
