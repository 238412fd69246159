"""The call forms beyond JSON and tags: Mistral v11+'s `[TOOL_CALLS]name[ARGS]{...}` and Gemma's (```tool_code fences,
FunctionGemma's and Gemma 4's `call:name{...}`): each family known by its template, its calls parsed the same streamed
or whole, its lazy grammar's triggers and forms (on plain text; with the real vocabulary where marked `models`)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from conftest import CODER_TEST_MODEL

from localllm.api import Tool
from localllm.chat.call_formats import (
    FUNCTION_GEMMA,
    GEMMA4,
    JSON_ONLY,
    MISTRAL,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    call_format,
    lazy_call_grammar,
    word_pattern,
)
from localllm.chat.tool_calls import ToolCallParser, parse_tool_calls
from localllm.models.store import Store

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate({"type": "function", "function": {"name": "add"}})]

TEMPLATES = [  # (a telltale line of the family's template, the family)
    (
        "{{- '[TOOL_CALLS]' + tool_call.function.name }}{{- '[CALL_ID]' + tool_call.id }}{{- '[ARGS]' }}",
        MISTRAL_CALL_ID,
    ),
    ('{{- "[TOOL_CALLS]" + tool["function"]["name"] + "[ARGS]" + arguments }}', MISTRAL_ARGS),  # Devstral, Ministral 3
    ('{{- "[TOOL_CALLS][" }}', MISTRAL),  # v3 to v7: a JSON array
    ("{{- '<start_function_call>call:' + function['name'] + '{' -}}", FUNCTION_GEMMA),
    ("{{- '<|tool_call>call:' + function['name'] + '{' -}}{{- '}<tool_call|>' -}}", GEMMA4),
    ("{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}", JSON_ONLY),  # Gemma 3
]


@pytest.mark.parametrize(("telltale", "fmt"), TEMPLATES, ids=[fmt.name for _, fmt in TEMPLATES])
def test_each_family_is_known_by_its_template(telltale, fmt):
    assert call_format("{% for message in messages %}" + telltale + "{% endfor %}") is fmt


# ---------------------------------------------------------------------------------------------------------- parsing

CALLS = [  # (answer, content, calls)
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    (
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": [2, "}"]}',
        "Sure. ",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, "}"]})],
    ),
    ('[TOOL_CALLS] add[CALL_ID]a1B2c3D4e[ARGS] {"a": 1}', "", [("add", {"a": 1})]),
    ('[TOOL_CALLS]add[ARGS]{"a": 1,}', "", [("add", {"a": 1})]),  # a trailing comma, repaired as in JSON calls
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', "", [("add", {"a": 1})]),  # v7's array still
    (
        "<start_function_call>call:get_weather{city:<escape>Paris, {France}<escape>}<end_function_call>",
        "",
        [("get_weather", {"city": "Paris, {France}"})],
    ),
    (
        "Two: <start_function_call>call:add{a:1,b:[2.5,<escape>x<escape>],c:{d:true,e:null}}<end_function_call>"
        "<start_function_call>call:get_weather{city:<escape>Rome<escape>}<end_function_call>",
        "Two: ",
        [("add", {"a": 1, "b": [2.5, "x"], "c": {"d": True, "e": None}}), ("get_weather", {"city": "Rome"})],
    ),
    ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', "", [("get_weather", {"city": "Paris"})]),
    ("<|tool_call>call:add{}<tool_call|>", "", [("add", {})]),
    (
        '```tool_code\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    ('```tool_call\n[{"name": "add", "arguments": {"a": 1}}]\n```', "", [("add", {"a": 1})]),
    # an unknown tool, or what follows the opener is no call: text, as before
    ('[TOOL_CALLS]unknown_tool[ARGS]{"a": 1}', '[TOOL_CALLS]unknown_tool[ARGS]{"a": 1}', []),
    ("[TOOL_CALLS]get_weather[ARGS]Paris", "[TOOL_CALLS]get_weather[ARGS]Paris", []),
    ("The [TOOL_CALLS] token opens calls.", "The [TOOL_CALLS] token opens calls.", []),
    (
        "<start_function_call>call:unknown_tool{a:1}<end_function_call>",
        "<start_function_call>call:unknown_tool{a:1}<end_function_call>",
        [],
    ),
    (
        "<start_function_call>call:get_weather{city:Paris}<end_function_call>",  # a string without its quotes
        "<start_function_call>call:get_weather{city:Paris}<end_function_call>",
        [],
    ),
    ("<start_function_call>hello", "<start_function_call>hello", []),
]


def _feed(answer: str, pieces) -> tuple[str, list, list]:
    """The answer fed in pieces: its content, its calls, and each streamed call's (name, arguments' JSON)."""
    parser = ToolCallParser(TOOLS)
    content, streamed = "", {}
    at = 0
    parts = []
    while at < len(answer):
        size = pieces()
        parts.append(parser.feed(answer[at : at + size]))
        at += size
    parts.append(parser.finish())
    for parsed in parts:
        content += parsed.content
        for delta in parsed.deltas:
            call = streamed.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            assert not (delta.id and call["id"])  # one id per call
            call["id"] = delta.id or call["id"]
            call["name"] = delta.name or call["name"]
            call["arguments"] += delta.arguments
    calls = [(c.function.name, c.function.arguments) for c in parser.calls]
    return content, calls, [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())]


@pytest.mark.parametrize(("answer", "content", "calls"), CALLS)
def test_the_calls_parse_the_same_streamed_and_whole(answer, content, calls):
    whole = _feed(answer, lambda: len(answer))
    assert whole[:2] == (content, calls)
    assert [(name, json.loads(arguments)) for name, arguments in whole[2]] == calls
    assert parse_tool_calls(answer, TOOLS)[0] == content
    for seed in range(40):
        rng = random.Random(seed)
        assert _feed(answer, lambda rng=rng: rng.randint(1, 6)) == whole


def test_mistral_v11_arguments_stream_as_they_arrive():
    parser = ToolCallParser(TOOLS)
    deltas = parser.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa').deltas
    assert deltas[0].name == "get_weather" and deltas[0].id and "".join(d.arguments for d in deltas) == '{"city": "Pa'
    deltas = parser.feed('ris"}').deltas + parser.finish().deltas
    assert "".join(d.arguments for d in deltas) == 'ris"}' and len(parser.calls) == 1


@pytest.mark.parametrize(
    "answer",
    [
        "[TOOL_CALLS]get_wea",
        '[TOOL_CALLS]get_weather[ARGS]{"ci',
        "<start_function_call>call:get_weather{city:<escape>Par",
        '<|tool_call>call:get_weather{city:<|"',
    ],
)
def test_a_call_cut_off_by_max_tokens_is_no_call_and_no_text(answer):
    parser = ToolCallParser(TOOLS)
    parsed = parser.feed(answer)
    parsed += parser.finish(cut=True)
    assert (parsed.content, parser.calls) == ("", [])


# ---------------------------------------------------------------------------------------------------------- grammar

NEW_FORMS = [MISTRAL_ARGS, MISTRAL_CALL_ID, FUNCTION_GEMMA, GEMMA4, JSON_ONLY]
FENCED_TRIGGERED = [
    '```tool_code\n{"name": "get_weather",',
    '```tool_call\n[{"name": "add", "',
]


@pytest.mark.parametrize("text", FENCED_TRIGGERED)
def test_a_gemma_fence_begun_with_a_call_triggers_where_the_answer_ends(text):
    lazy = lazy_call_grammar(TOOLS, JSON_ONLY)
    assert any(re.fullmatch(p.removeprefix("^").removesuffix("$"), text) for p in lazy.triggers.patterns)
    assert not any(re.fullmatch(p.removeprefix("^").removesuffix("$"), text + "x") for p in lazy.triggers.patterns)


@pytest.mark.parametrize("fmt", NEW_FORMS, ids=lambda f: f.name)
def test_each_form_triggers_on_its_opener_and_offers_only_the_tools(fmt):
    lazy = lazy_call_grammar(TOOLS, fmt)
    assert lazy.triggers.words == ((fmt.opener,) if fmt.opener else ())
    if fmt.opener:
        assert re.search(word_pattern(fmt.opener), f"Let me check. {fmt.opener}")
        assert "root ::= bare | fenced | opened" in lazy.grammar
        assert '"get_weather"' in lazy.grammar and '"add"' in lazy.grammar  # the opened form's names
    assert '"\\"get_weather\\""' in lazy.grammar and '"\\"add\\""' in lazy.grammar  # the JSON forms' names
    assert '"tool_code"' in lazy.grammar and '"tool_call"' in lazy.grammar  # Gemma's fences, whatever the family


def _opened(grammar: str) -> str:
    return next(line for line in grammar.splitlines() if line.startswith("opened ::="))


@pytest.mark.parametrize("fmt", [MISTRAL_ARGS, FUNCTION_GEMMA, GEMMA4], ids=lambda f: f.name)
def test_the_opened_form_repeats_only_when_parallel(fmt):
    assert _opened(lazy_call_grammar(TOOLS, fmt).grammar).endswith("call)*")
    assert "*" not in _opened(lazy_call_grammar(TOOLS, fmt, parallel=False).grammar)


def test_mistral_v11_arguments_are_held_to_each_tools_own_schema():
    grammar = lazy_call_grammar(TOOLS, MISTRAL_ARGS).grammar
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    named = rules["named-tool"]
    assert named == '"get_weather" "[ARGS]" args0-root | "add" "[ARGS]" args1-root'
    assert '"\\"city\\""' in rules["args0-city-kv"] and rules["args0-root"].startswith('"{"')
    assert rules["args1-root"] == "args1-object"  # no parameters: any object
    assert "[CALL_ID]" in lazy_call_grammar(TOOLS, MISTRAL_CALL_ID).grammar and "[CALL_ID]" not in named
    # every rule a name refers to is defined once: the tools' rules are renamed apart
    names = [line.split(" ::= ")[0] for line in grammar.splitlines()]
    assert len(names) == len(set(names))
    bodies = re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', "", grammar)  # no literals, no classes
    assert set(re.findall(r"[A-Za-z][A-Za-z0-9-]*", bodies)) <= set(names)


def test_gemma_keys_are_the_tools_own():
    rules = dict(line.split(" ::= ", 1) for line in lazy_call_grammar(TOOLS, FUNCTION_GEMMA).grammar.splitlines())
    assert rules["gemma-kv0"] == '("city") ":" space gemma-value'
    assert rules["gemma-kv1"] == '(gemma-key) ":" space gemma-value'  # no properties listed: any key
    assert rules["gemma-call"].startswith('"<start_function_call>" space "call:" gemma-tool')


# ---------------------------------------------------------------------------------------------------------- llama.cpp

WHOLE = {  # each form's calls, as llama.cpp's grammar must take them, and what it must refuse
    MISTRAL_ARGS.name: (
        ['[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{}'],
        ['[TOOL_CALLS]get_weather[ARGS]{"city": {"name": "Paris"}}', '[TOOL_CALLS]locate[ARGS]{"a": 1}'],
    ),
    MISTRAL_CALL_ID.name: (
        ['[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', '[TOOL_CALLS]add[ARGS]{"a": 1}'],
        ['[TOOL_CALLS]add[CALL_ID]short[ARGS]{"a": 1}'],
    ),
    FUNCTION_GEMMA.name: (
        [
            "<start_function_call>call:get_weather{city:<escape>Paris, {France}<escape>}<end_function_call>",
            "<start_function_call>call:add{a:1,b:[2.5,<escape>x<escape>],c:{d:true}}<end_function_call>",
        ],
        [
            "<start_function_call>call:get_weather{town:<escape>Paris<escape>}<end_function_call>",
            "<start_function_call>call:locate{a:1}<end_function_call>",
        ],
    ),
    GEMMA4.name: (['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'], ["<|tool_call>call:add{a:x}"]),
    JSON_ONLY.name: (
        ['```tool_code\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'],
        ['```python\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'],
    ),
}
NOT_TRIGGERED = ['The answer is {"name": "add",', '{"name": "locate_cafes",', "```python\nprint(1)\n```", "Hello"]


def _weights(coder_home) -> Path:
    return Store(Path(coder_home) / "models").resolve(CODER_TEST_MODEL).weights


@pytest.mark.models
@pytest.mark.parametrize("fmt", NEW_FORMS, ids=lambda f: f.name)
def test_llama_cpp_takes_every_trigger_into_the_grammar_and_leaves_the_rest_free(coder_home, tmp_path, fmt):
    """As tests/test_tool_calls.py's test of the same name, for the new forms: a replay the grammar rejects would
    abort the probe's process."""
    from grammar_probe import holding_after

    lazy = lazy_call_grammar(TOOLS, fmt)
    begun = [*FENCED_TRIGGERED, *([fmt.opener, f"Let me check. {fmt.opener}\n"] if fmt.opener else [])]
    seen = holding_after(_weights(coder_home), lazy, begun + NOT_TRIGGERED, tmp_path)
    assert seen == {**{t: True for t in begun}, **{t: False for t in NOT_TRIGGERED}}


def _taken(model, grammar: str, text: str) -> bool:
    """Whether the grammar (held from the first token) takes every token of `text`: each is checked before it is
    accepted, so a refused one is reported, not fed."""
    import llama_cpp
    from grammar_probe import holds

    from localllm.backends.llama_cpp.backend import _grammar_sampler

    sampler = _grammar_sampler(model, grammar, None)
    try:
        for token in model.tokenize(text, add_special=False, parse_special=True):
            if holds(sampler, token):
                return False
            llama_cpp.llama_sampler_accept(sampler, token)
        return True
    finally:
        llama_cpp.llama_sampler_free(sampler)


@pytest.mark.models
def test_llama_cpp_takes_each_forms_calls_and_refuses_what_no_offered_tool_takes(coder_home):
    from localllm.api import LoadOptions
    from localllm.backends.llama_cpp.backend import LlamaCppBackend

    model = LlamaCppBackend().load(_weights(coder_home), LoadOptions(num_ctx=256, num_parallel=1, num_thread=1))
    try:
        for fmt in NEW_FORMS:
            good, bad = WHOLE[fmt.name]
            grammar = lazy_call_grammar(TOOLS, fmt).grammar
            assert [_taken(model, grammar, text) for text in good] == [True] * len(good), fmt.name
            assert [_taken(model, grammar, text) for text in bad] == [False] * len(bad), fmt.name
            if fmt.opener:  # one call at most unless parallel
                one = lazy_call_grammar(TOOLS, fmt, parallel=False).grammar
                assert _taken(model, one, good[0]) and not _taken(model, one, good[0] + good[0]), fmt.name
    finally:
        model.close()
