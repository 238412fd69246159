"""Tool calls: the one parser (every shape models write, fed in any pieces), and a real tool-calling model
(qwen2.5-coder:0.5b) on every route, streamed and not, through the official `ollama`, `openai` and `anthropic`
packages. Streamed calls must arrive as call deltas, never as text, and add up to the non-streamed answer."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import anthropic
import gguf
import ollama
import openai
import pytest
from conftest import CODER_TEST_MODEL, PINNED_CODER

from localllm.api import Message, Tool, ToolCall, ToolCallFunction
from localllm.chat.call_formats import HERMES, JSON_ONLY, LLAMA3, MISTRAL, call_format, lazy_call_grammar, word_pattern
from localllm.chat.templates import render_chat
from localllm.chat.tool_calls import ToolCallParser, parse_tool_calls
from localllm.models.store import Store

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate({"type": "function", "function": {"name": "add"}})]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# ---------------------------------------------------------------------------------------------------------- parser

CALLS = [
    # (answer, content, calls): Qwen's tags, several in a row, fenced and bare JSON, arrays, other key names
    (
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, "}"]})],
    ),
    ('{"name": "get_weather", "arguments": {"city": "Pa\\"ris"}}', "", [("get_weather", {"city": 'Pa"ris'})]),
    (
        '[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "add", "arguments": {"a": 1}}]',
        "",
        [("get_weather", {"city": "A"}), ("add", {"a": 1})],
    ),
    (
        'Let me check. <tool_call>{"name": "get_weather", "parameters": {"city": "X"}}</tool_call>',
        "Let me check. ",
        [("get_weather", {"city": "X"})],
    ),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', "", [("get_weather", {"city": "Rome"})]),
    ('{"type": "function", "function": {"name": "add", "arguments": {"a": 3}}}', "", [("add", {"a": 3})]),
    (
        '\n{"name": "get_weather", "arguments": {}}\n{"name": "add", "arguments": {"a": 2}}',
        "",
        [
            ("get_weather", {}),
            ("add", {"a": 2}),
        ],
    ),
    # near calls, repaired: a wrong wrapper, trailing commas
    ('<json>{"name": "get_weather", "arguments": {"city": "Oslo"}}</json>', "", [("get_weather", {"city": "Oslo"})]),
    (
        'Calling: <tools>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3,],},}\n</tools>',
        "Calling: ",
        [("add", {"a": 1, "b": [2, 3]})],
    ),
    ('{"name": "get_weather", "arguments": {"city": "Lima" , }}', "", [("get_weather", {"city": "Lima"})]),
    # a near call whose arguments do not fit its tool stays text
    (
        '<json>{"name": "get_weather", "arguments": {"town": "Oslo"}}</json>',
        '<json>{"name": "get_weather", "arguments": {"town": "Oslo"}}</json>',
        [],
    ),
    (
        '{"name": "get_weather", "arguments": "{\\"city\\": 7}"}',
        '{"name": "get_weather", "arguments": "{\\"city\\": 7}"}',
        [],
    ),
    # text that only looks like the start of a call goes out as text after all
    ("Code:\n```python\nprint({1: 2})\n```\nDone.", "Code:\n```python\nprint({1: 2})\n```\nDone.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('```json\n{"foo": 1}\n```', '```json\n{"foo": 1}\n```', []),
    ('{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}', []),
    ("a < b and ``` inline", "a < b and ``` inline", []),
    ("<tool_call> is how I call tools", "<tool_call> is how I call tools", []),
]


def _feed(answer: str, pieces) -> tuple[str, list, dict[int, dict]]:
    parser = ToolCallParser(TOOLS)
    content, streamed = "", {}
    cuts = [0]
    while cuts[-1] < len(answer):
        cuts.append(cuts[-1] + pieces())
    parts = [parser.feed(answer[a:b]) for a, b in zip(cuts, cuts[1:])] + [parser.finish()]
    for parsed in parts:
        content += parsed.content
        for delta in parsed.deltas:
            call = streamed.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] = delta.name or call["name"]
            call["arguments"] += delta.arguments
    return content, [(c.function.name, c.function.arguments) for c in parser.calls], streamed


@pytest.mark.parametrize(("answer", "content", "calls"), CALLS)
def test_the_parser_finds_the_calls_however_the_answer_is_cut(answer, content, calls):
    whole = _feed(answer, lambda: len(answer))
    assert whole[:2] == (content, calls)
    # The streamed deltas are the calls: one id and name each, arguments adding up to the same JSON.
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(whole[2].items())] == calls
    for seed in range(40):
        rng = random.Random(seed)
        cut = _feed(answer, lambda rng=rng: rng.randint(1, 5))
        assert cut[:2] == whole[:2] and [c["arguments"] for c in cut[2].values()] == [
            c["arguments"] for c in whole[2].values()
        ]


def test_arguments_stream_in_pieces_and_a_cut_off_call_keeps_its_partial_arguments():
    parser = ToolCallParser(TOOLS)
    answer = '{"name": "get_weather", "arguments": {"city": "Par'
    deltas = [d for piece in answer.split(" ") for d in parser.feed(piece + " ").deltas] + parser.finish().deltas
    assert deltas[0].id and deltas[0].name == "get_weather" and not deltas[0].arguments
    assert len(deltas) > 2 and "".join(d.arguments for d in deltas).startswith('{"city": "Par')
    assert parser.calls == []  # not a whole call


@pytest.mark.parametrize(
    ("answer", "content"),
    [
        ('```json\n{\n  "name": "get_wea', ""),
        ('{"name": "get_weather", "argu', ""),
        ('Sure. <tool_call>\n{"na', "Sure. "),
        ('[{"type": "function", "func', ""),
        ('{"answer": 4', '{"answer": 4'),  # JSON that is no call, cut: text as it was
        ('{"name": "unknown_tool", "argu', '{"name": "unknown_tool", "argu'),
    ],
)
def test_a_candidate_cut_off_by_max_tokens_is_no_call_and_no_text(answer, content):
    parser = ToolCallParser(TOOLS)
    parsed = parser.feed(answer)
    parsed += parser.finish(cut=True)
    assert (parsed.content, parser.calls) == (content, [])
    uncut = ToolCallParser(TOOLS)
    assert (uncut.feed(answer).content + uncut.finish().content).endswith(answer[len(content) :])  # ended: text


def test_each_repair_is_said_with_its_tool():
    parser = ToolCallParser(TOOLS)
    parser.feed('<json>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}",}</json> and ')
    parser.feed('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    parser.finish()
    assert parser.repairs == ["get_weather: in <json>, trailing comma, arguments as a string"]
    assert [c.function.arguments for c in parser.calls] == [{"city": "Oslo"}, {"a": 1}]


def test_the_repairs_header_lists_every_answers_repairs():
    from starlette.responses import JSONResponse

    from localllm.api import ChatChunk
    from localllm.server.ignored import REPAIRED_HEADER, with_repairs

    answers = [ChatChunk(model="m", repairs=["add: trailing comma"]), ChatChunk(model="m"), ChatChunk(model="m")]
    answers[2].repairs = ["get_weather: in <json>"]
    response = with_repairs(JSONResponse({}), answers)
    assert response.headers[REPAIRED_HEADER] == "add: trailing comma; get_weather: in <json>"
    assert REPAIRED_HEADER not in with_repairs(JSONResponse({}), answers[1:2]).headers


def test_the_whole_answer_parser_is_the_streaming_one():
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', TOOLS)[1][0].function == (
        ToolCallFunction(name="add", arguments={"a": 1})
    )


# ---------------------------------------------------------------------------------------------------------- template


@pytest.mark.models
def test_the_qwen_template_renders_tools_multi_call_turns_and_results(coder_home):

    weights = Store(Path(coder_home) / "models").resolve(CODER_TEST_MODEL).weights
    field = gguf.GGUFReader(str(weights)).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    calls = [
        ToolCall(id=f"call_{c}", function=ToolCallFunction(name="get_weather", arguments={"city": c})) for c in "AB"
    ]
    messages = [
        Message(role="user", content="Weather in A and B?"),
        Message(role="assistant", tool_calls=calls),
        Message(role="tool", content='{"c": 21}', tool_name="get_weather"),
        Message(role="tool", content='{"c": 25}', tool_name="get_weather"),
    ]
    prompt = render_chat(template, [m.model_dump(exclude_none=True) for m in messages], tools=[WEATHER])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.count('<tool_call>\n{"name": "get_weather"') == 2 and '"arguments": {"city": "B"}' in prompt
    assert '<tool_response>\n{"c": 21}\n</tool_response>\n<tool_response>\n{"c": 25}' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------------------- routes


def _assert_weather(name: str, arguments: dict) -> None:
    assert name == "get_weather" and isinstance(arguments.get("city"), str) and arguments["city"]


@pytest.mark.models
def test_ollama_chat_calls_the_tool_streamed_and_not(coder_url):
    client = ollama.Client(host=coder_url)
    whole = client.chat(model=PINNED_CODER, messages=ASK, tools=[WEATHER], options={"num_predict": 80})
    (call,) = whole.message.tool_calls
    _assert_weather(call.function.name, call.function.arguments)
    assert not (whole.message.content or "").strip()
    chunks = list(
        client.chat(model=PINNED_CODER, messages=ASK, tools=[WEATHER], options={"num_predict": 80}, stream=True)
    )
    streamed = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]
    assert not "".join(chunk.message.content or "" for chunk in chunks).strip()  # never as text


@pytest.mark.models
def test_openai_chat_streams_the_call_as_argument_deltas(coder_url):
    oai = openai.OpenAI(base_url=coder_url + "/v1", api_key="none", max_retries=0)
    ask = dict(model=PINNED_CODER, messages=ASK, tools=[WEATHER], max_tokens=80)
    whole = oai.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    _assert_weather(call.function.name, json.loads(call.function.arguments))
    chunks = list(oai.chat.completions.create(**ask, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    # As OpenAI streams a call: the first delta has the id and name, the next ones pieces of the arguments.
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.models
def test_anthropic_messages_stream_tool_use_with_input_json_deltas(coder_url):
    claude = anthropic.Anthropic(base_url=coder_url, api_key="none", max_retries=0)
    ask = dict(model=PINNED_CODER, max_tokens=80, messages=ASK, tools=[_anthropic_tool()])
    whole = claude.messages.create(**ask)
    (block,) = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and not [b for b in whole.content if b.type == "text" and b.text.strip()]
    _assert_weather(block.name, block.input)
    with claude.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.name == "get_weather"
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == block.input
    assert final.stop_reason == "tool_use" and final.content[0].input == block.input

    # The result goes back as a tool_result block, which the model's template renders as a tool turn.
    def result_turn(result: str) -> list[dict]:
        call = {"role": "assistant", "content": [block.model_dump(exclude_none=True)]}
        reply = {"type": "tool_result", "tool_use_id": block.id, "content": result}
        return [*ASK, call, {"role": "user", "content": [reply]}]

    def count(result: str) -> int:
        turn = result_turn(result)
        return claude.messages.count_tokens(model=PINNED_CODER, tools=[_anthropic_tool()], messages=turn).input_tokens

    assert count("sunny " * 21) - count("sunny") >= 20
    answer = claude.messages.create(
        model=PINNED_CODER, max_tokens=8, tools=[_anthropic_tool()], messages=result_turn("18 C")
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.models
def test_responses_stream_a_function_call_item(coder_url):
    oai = openai.OpenAI(base_url=coder_url + "/v1", api_key="none", max_retries=0)
    tool = {"type": "function", **WEATHER["function"]}
    ask = dict(model=PINNED_CODER, input=ASK[0]["content"], tools=[tool], max_output_tokens=80, store=False)
    whole = oai.responses.create(**ask)
    (item,) = [i for i in whole.output if i.type == "function_call"]
    _assert_weather(item.name, json.loads(item.arguments))
    assert not [i for i in whole.output if i.type == "message"]
    events = list(oai.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == json.loads(item.arguments)
    done = next(e for e in events if e.type == "response.completed").response
    assert [i.type for i in done.output] == ["function_call"]


def _anthropic_tool() -> dict:
    function = WEATHER["function"]
    return {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}


# ------------------------------------------------------------------------------------------------- streamed = whole


def _openai_calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


@pytest.mark.models
def test_a_streamed_call_equals_the_whole_one_on_every_route(coder_url):
    """The clients' own stream helpers add the pieces up to the non-streamed calls, on all four routes."""
    oai = openai.OpenAI(base_url=coder_url + "/v1", api_key="none", max_retries=0)
    ask = dict(model=PINNED_CODER, messages=ASK, tools=[WEATHER], max_tokens=80)
    whole = _openai_calls(oai.chat.completions.create(**ask).choices[0].message.tool_calls)
    assert len(whole) == 1
    _assert_weather(*whole[0])
    raw = list(oai.chat.completions.create(**ask, stream=True))
    for chunk in raw:  # one entry per call in a chunk, as OpenAI sends: a second one would be a second call
        indexes = [d.index for c in chunk.choices for d in c.delta.tool_calls or []]
        assert len(indexes) == len(set(indexes))
    with oai.chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion().choices[0]
    assert _openai_calls(final.message.tool_calls) == whole and final.finish_reason == "tool_calls"

    tool = {"type": "function", **WEATHER["function"]}
    asked = dict(model=PINNED_CODER, input=ASK[0]["content"], tools=[tool], max_output_tokens=80, store=False)
    items = oai.responses.create(**asked).output
    with oai.responses.stream(**asked) as stream:
        streamed_items = stream.get_final_response().output
    for output in (items, streamed_items):
        assert [(i.name, json.loads(i.arguments)) for i in output if i.type == "function_call"] == whole

    claude = anthropic.Anthropic(base_url=coder_url, api_key="none", max_retries=0)
    said = dict(model=PINNED_CODER, max_tokens=80, messages=ASK, tools=[_anthropic_tool()])
    with claude.messages.stream(**said) as stream:
        streamed = stream.get_final_message()
    for message in (claude.messages.create(**said), streamed):
        assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == whole

    client = ollama.Client(host=coder_url)
    options = {"num_predict": 80}
    ollama_whole = client.chat(model=PINNED_CODER, messages=ASK, tools=[WEATHER], options=options).message
    chunks = client.chat(model=PINNED_CODER, messages=ASK, tools=[WEATHER], options=options, stream=True)
    ollama_streamed = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    for calls in (ollama_whole.tool_calls, ollama_streamed):
        assert [(c.function.name, dict(c.function.arguments)) for c in calls or []] == whole


# ------------------------------------------------------------------------------------------------- cut off


def _no_json_text(text: str | None) -> None:
    assert not (text or "").strip(), f"a partial call leaked as text: {text!r}"


@pytest.mark.models
@pytest.mark.parametrize("budget", [4, 9, 14])
def test_a_call_cut_off_by_max_tokens_says_so_and_is_no_call_on_every_route(coder_url, budget):
    """Cut before its head is whole, in its arguments, or near its end: the stop reason says the cut, and the whole
    answer holds no call and no raw JSON text; a stream ends with the same reason."""
    oai = openai.OpenAI(base_url=coder_url + "/v1", api_key="none", max_retries=0)
    ask = dict(model=PINNED_CODER, messages=ASK, tools=[WEATHER], max_tokens=budget)
    whole = oai.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "length" and not whole.message.tool_calls
    _no_json_text(whole.message.content)
    chunks = list(oai.chat.completions.create(**ask, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    _no_json_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    claude = anthropic.Anthropic(base_url=coder_url, api_key="none", max_retries=0)
    said = dict(model=PINNED_CODER, max_tokens=budget, messages=ASK, tools=[_anthropic_tool()])
    message = claude.messages.create(**said)
    assert message.stop_reason == "max_tokens" and [b.type for b in message.content] in ([], ["text"])
    _no_json_text("".join(b.text for b in message.content if b.type == "text"))
    with claude.messages.stream(**said) as stream:
        events = list(stream)
    stop = [e.delta.stop_reason for e in events if e.type == "message_delta"]
    assert stop == ["max_tokens"]
    _no_json_text(
        "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    )

    tool = {"type": "function", **WEATHER["function"]}
    asked = dict(model=PINNED_CODER, input=ASK[0]["content"], tools=[tool], max_output_tokens=budget, store=False)
    response = oai.responses.create(**asked)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert not [i for i in response.output if i.type == "function_call"]
    _no_json_text(response.output_text)
    events = list(oai.responses.create(**asked, stream=True))
    assert events[-1].type == "response.incomplete"
    _no_json_text("".join(e.delta for e in events if e.type == "response.output_text.delta"))

    client = ollama.Client(host=coder_url)
    options = {"num_predict": budget}
    reply = client.chat(model=PINNED_CODER, messages=ASK, tools=[WEATHER], options=options)
    assert reply.done_reason == "length" and not reply.message.tool_calls
    _no_json_text(reply.message.content)
    chunks = list(client.chat(model=PINNED_CODER, messages=ASK, tools=[WEATHER], options=options, stream=True))
    assert chunks[-1].done_reason == "length" and not [c for ch in chunks for c in ch.message.tool_calls or []]
    _no_json_text("".join(ch.message.content or "" for ch in chunks))


# ------------------------------------------------------------------------------------------- constrained once begun

FAMILIES = {  # a template's telltale, its family, and a call the family writes
    "<tool_call>": (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    "[TOOL_CALLS]": (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    "<|python_tag|>": (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "{{ messages }}": (JSON_ONLY, '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
}
TRIGGERED = [  # answers so far that end where a call's grammar takes over: a call's head naming an offered tool
    '{"name": "get_weather"',
    '  {\n    "name"  :  "add",',
    '[{"name": "get_weather", "',
    '```json\n{\n  "name": "add",\n  ',
    '```\n[ {"name": "get_weather",',
]
NOT_TRIGGERED = [
    'The answer is {"name": "add",',
    '{"name": "locate_cafes",',  # a tool that was not offered: left free, and the parser leaves it text
    '{"name": "add"}',
    '{"answer": 42}',
    "```python\nprint(1)\n```",
    "```json\n[1, 2]",
]
RAN_PAST = '{"name": "x"} and more'  # whole: the trigger matched only where an answer so far ended


@pytest.mark.parametrize("telltale", list(FAMILIES))
def test_each_template_family_is_known_by_its_opener_and_its_calls_parse(telltale):
    fmt, written = FAMILIES[telltale]
    assert call_format("{% for m in messages %}" + telltale + "{% endfor %}") is fmt
    text, calls = parse_tool_calls(written, TOOLS)
    assert not text.strip() and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize("text", TRIGGERED)
def test_a_json_call_begun_at_the_answers_start_triggers_where_the_answer_ends(text):
    lazy = lazy_call_grammar(TOOLS, JSON_ONLY)
    assert any(re.fullmatch(p.removeprefix("^").removesuffix("$"), text) for p in lazy.triggers.patterns)


@pytest.mark.parametrize("text", [*NOT_TRIGGERED, RAN_PAST])
def test_text_and_json_that_is_no_call_stay_free(text):
    lazy = lazy_call_grammar(TOOLS, HERMES)
    assert not any(re.fullmatch(p.removeprefix("^").removesuffix("$"), text) for p in lazy.triggers.patterns)
    assert not re.search(word_pattern("<tool_call>"), text)


def test_an_opener_spelt_in_pieces_triggers_only_where_the_answer_ends():
    assert re.search(word_pattern("[TOOL_CALLS]"), "Sure. [TOOL_CALLS]")
    assert re.search(word_pattern("<tool_call>"), "ok <tool_call>\n")
    assert not re.search(word_pattern("<tool_call>"), "ok <tool_call>{")  # the grammar starts only at its end


def test_the_call_grammar_offers_only_the_tools_and_one_call_unless_parallel():
    for fmt in (HERMES, MISTRAL, LLAMA3, JSON_ONLY):
        grammar = lazy_call_grammar(TOOLS, fmt).grammar
        assert '"\\"get_weather\\""' in grammar and '"\\"add\\""' in grammar and "root ::= bare | fenced" in grammar
        one = lazy_call_grammar(TOOLS, fmt, parallel=False).grammar
        assert "(space tool-call)*" in grammar and "tool-call)*" not in one.split("\ntool-call ::=")[0]
    assert '"\\"parameters\\""' in lazy_call_grammar(TOOLS, LLAMA3).grammar


@pytest.mark.models
@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3, JSON_ONLY], ids=lambda f: f.name)
def test_llama_cpp_takes_every_trigger_into_the_grammar_and_leaves_the_rest_free(coder_home, tmp_path, fmt):
    """The triggers as llama.cpp's sampler meets them, token by token, in a process of its own (a replay the grammar
    rejects would abort it): every call's beginning puts the grammar in charge; text that is no call never does."""
    from grammar_probe import holding_after

    weights = Store(Path(coder_home) / "models").resolve(CODER_TEST_MODEL).weights
    lazy = lazy_call_grammar(TOOLS, fmt)
    opened = [f"{fmt.opener}", f"Let me check. {fmt.opener}\n"] if fmt.opener else []
    written = FAMILIES_BY_NAME[fmt.name]
    begun = [*TRIGGERED, *opened]
    if fmt in (HERMES, JSON_ONLY):  # openers this vocabulary spells in pieces may merge with what follows: left free
        begun.append(written[: written.index('"city":') + 7])  # the call, up to its argument's value
    seen = holding_after(weights, lazy, begun + NOT_TRIGGERED, tmp_path)
    assert seen == {**{t: True for t in begun}, **{t: False for t in NOT_TRIGGERED}}


FAMILIES_BY_NAME = {fmt.name: written for fmt, written in FAMILIES.values()}


@pytest.mark.models
def test_parallel_tool_calls_false_gives_one_call_at_most(coder_url):
    oai = openai.OpenAI(base_url=coder_url + "/v1", api_key="none", max_retries=0)
    two = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    ask = dict(model=PINNED_CODER, messages=two, tools=[WEATHER], max_tokens=120, parallel_tool_calls=False)
    whole = oai.chat.completions.create(**ask).choices[0]
    assert len(whole.message.tool_calls) == 1 and not (whole.message.content or "").strip()
    _assert_weather(*_openai_calls(whole.message.tool_calls)[0])


def _place_tool(name: str, location: dict) -> dict:
    parameters = {"type": "object", "properties": {"location": location}, "required": ["location"]}
    return {"type": "function", "function": {"name": name, "description": "Find places", "parameters": parameters}}


@pytest.mark.models
def test_a_lazy_grammar_holds_a_begun_call_to_the_offered_tools_and_their_schemas(coder_home):
    """The prompt offers one tool; the grammar another (an object where it says string, or another name): what the
    model writes free shows the difference, and once its call begins the grammar's tool and schema hold."""
    from localllm.api import LoadOptions, SamplingOptions
    from localllm.backends.llama_cpp.backend import LlamaCppBackend
    from localllm.engine.runner import GenerationParams, ModelEngine

    weights = Store(Path(coder_home) / "models").resolve(CODER_TEST_MODEL).weights
    field = gguf.GGUFReader(str(weights)).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    opts = LoadOptions(num_thread=1, num_ctx=1024, num_parallel=1)
    engine = ModelEngine(LlamaCppBackend().load(weights, opts), max_queue=2)
    greedy = SamplingOptions(temperature=0, num_predict=60, spec_type="none")
    ask = [{"role": "user", "content": "Find cafes near Istanbul, Turkey."}]

    def call(prompt_tool: dict, grammar_tool: dict | None, parsed_with: list[dict] | None = None):
        prompt = engine.tokenize(render_chat(template, ask, tools=[prompt_tool]), add_special=False)
        lazy = lazy_call_grammar([Tool.model_validate(grammar_tool)], call_format(template)) if grammar_tool else None
        params = GenerationParams(prompt, greedy, lazy.grammar if lazy else None)
        params.grammar_triggers = lazy.triggers if lazy else None
        answer = "".join(chunk.text for chunk in engine.submit(params))
        offered = parsed_with or [prompt_tool, *([grammar_tool] if grammar_tool else [])]
        calls = parse_tool_calls(answer, [Tool.model_validate(t) for t in offered])[1]
        if not calls:
            return None
        (found,) = calls
        return found.function.name, found.function.arguments

    try:
        as_object = _place_tool("find_place", {"type": "object", "description": "its city and country"})
        as_string = _place_tool("find_place", {"type": "string"})
        assert isinstance(call(as_object, None)[1]["location"], dict)  # free, the model follows the prompt
        name, arguments = call(as_object, as_string)
        assert name == "find_place" and isinstance(arguments["location"], str)
        unknown = _place_tool("locate_cafes", {"type": "string"})
        assert call(unknown, None)[0] == "locate_cafes"
        # a tool that was not offered is never called: begun in the template's tags, the call is held to an offered
        # tool; begun as JSON, it stays free and the parser (which knows the offered tools) leaves it text
        found = call(unknown, as_string, parsed_with=[as_string])
        assert found is None or found[0] == "find_place"
    finally:
        engine.close()
