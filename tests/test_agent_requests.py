"""The agent APIs' request translation, without a model: Anthropic Messages and OpenAI Responses bodies into our
chat requests, and the errors that name what cannot be expressed."""

from __future__ import annotations

import pytest

from localllm import api
from localllm.errors import InvalidInput
from localllm.server.anthropic import requests as anthropic
from localllm.server.openai import responses_requests as responses


def messages_body(**fields) -> anthropic.MessagesRequest:
    return anthropic.MessagesRequest.model_validate({"model": "m", "max_tokens": 16, **fields})


def test_anthropic_blocks_become_our_messages():
    body = messages_body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "a tool", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "is_error": True,
                        "content": [{"type": "text", "text": "timeout"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        tool_choice={"type": "tool", "name": "weather"},
        stop_sequences=["END"],
        top_k=5,
        thinking={"type": "disabled"},
    )
    request = anthropic.chat_request(body)
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Weather?"),
        ("assistant", "Checking."),
        ("tool", "sunny"),
        ("tool", "Error: timeout"),
        ("user", "And tomorrow?"),
    ]
    assistant = request.messages[2]
    assert assistant.thinking == "a tool" and assistant.tool_calls[0].function.arguments == {"city": "Rome"}
    assert request.messages[3].tool_name == "weather"
    assert request.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert request.options == {"num_predict": 16, "top_k": 5, "stop": ["END"]} and request.think is False


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type 'sometimes'"),
        ({"tool_choice": {"type": "tool"}}, "needs the tool's name"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "budget_tokens 0"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ],
)
def test_anthropic_refusals_name_the_field(fields, message):
    body = messages_body(**{"messages": [{"role": "user", "content": "hi"}], **fields})
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(".", r"\.")):
        anthropic.chat_request(body)


def test_responses_items_become_our_messages():
    body = responses.ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "reasoning": {"effort": "minimal"},
            "max_output_tokens": 9,
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_object"}},
            "input": [
                {"role": "developer", "content": "Answer in French."},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
                {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
                {"type": "function_call_output", "call_id": "c2", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c1", "output": "rainy"},
                {"role": "user", "content": [{"type": "input_text", "text": "So?"}]},
            ],
        }
    )
    earlier = [
        api.Message(role="user", content="Paris?"),
        api.Message(
            role="assistant", tool_calls=[api.ToolCall(id="c1", function=api.ToolCallFunction(name="forecast"))]
        ),
    ]
    request = responses.chat_request(body, earlier)
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Paris?"),
        ("assistant", ""),
        ("system", "Answer in French."),
        ("assistant", ""),
        ("tool", "sunny"),
        ("tool", "rainy"),
        ("user", "So?"),
    ]
    assert request.messages[4].thinking == "hmm" and request.messages[4].tool_calls[0].function.name == "weather"
    assert [m.tool_name for m in request.messages[5:7]] == ["weather", "forecast"]  # the earlier call by its id
    assert request.think == "low" and request.format == "json" and request.options == {"num_predict": 9}
    assert request.tool_choice == {"type": "function", "function": {"name": "weather"}}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"role": "critic", "content": "x"}]}, "role 'critic'"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "not valid JSON"),
        ({"tools": [{"type": "function"}]}, "needs a name"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type 'yaml'"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort 'extreme'"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ],
)
def test_responses_refusals_name_the_field(fields, message):
    body = responses.ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    with pytest.raises(InvalidInput, match=message):
        responses.chat_request(body, [])


def test_tools_that_cannot_run_here_are_left_out(caplog):
    mine = {"name": "weather", "input_schema": {"type": "object"}}
    body = messages_body(
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "web_search_20250305", "name": "web_search"}, mine],
    )
    assert [t.function.name for t in anthropic.chat_request(body).tools] == ["weather"]
    codex = responses.ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": "hi",
            "tools": [
                {"type": "web_search"},
                {"type": "custom", "name": "apply_patch"},
                {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            ],
        }
    )
    assert [t.function.name for t in responses.chat_request(codex, []).tools] == ["shell"]
    assert "web_search" in caplog.text and "apply_patch" in caplog.text


def test_a_system_message_between_turns_becomes_a_reminder_in_a_user_turn():
    # Claude Code's mid-conversation-system beta: the agent list arrives as a system message after the first turn.
    body = messages_body(
        system="Be brief.",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "Answer in English."}]},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Agents: explore, plan."},
            {"role": "user", "content": "Plan a trip."},
            {"role": "system", "content": "Keep it short."},
        ],
    )
    request = anthropic.chat_request(body)
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief.\n\nAnswer in English."),
        ("user", "Hi"),
        ("assistant", "Hello."),
        (
            "user",
            "<system-reminder>\nAgents: explore, plan.\n</system-reminder>\nPlan a trip.\n"
            "<system-reminder>\nKeep it short.\n</system-reminder>\n",
        ),
    ]


@pytest.mark.parametrize(
    "first_turn",
    [
        [{"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]}],
        [
            {"role": "user", "content": "Run it."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
    ],
    ids=["after-text", "after-tool-results"],
)
def test_a_reminder_after_the_last_turn_renders_the_same_once_turns_follow(first_turn):
    # Claude Code sends its agent list after the last user turn; the next request keeps it there and adds turns
    # after it, so the first request's messages must stay the second's prefix for the prompt cache to hold.
    reminder = {"role": "system", "content": "Agents: explore, plan."}
    first = anthropic.chat_request(messages_body(messages=[*first_turn, reminder])).messages
    second = anthropic.chat_request(
        messages_body(
            messages=[
                *first_turn,
                reminder,
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": "Thanks"},
            ]
        )
    ).messages
    assert second[: len(first)] == first
    assert "<system-reminder>\nAgents: explore, plan.\n</system-reminder>" in first[-1].content


def test_a_conversation_of_system_messages_alone_is_refused():
    with pytest.raises(InvalidInput, match="at least one user message"):
        anthropic.chat_request(messages_body(messages=[{"role": "system", "content": "Be brief."}]))
