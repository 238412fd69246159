"""Thinking: the splitter on its own, then a reasoning model (smollm2 under a reasoning template, tests/
reasoning_model.py) on every route, streamed and not, through the real ollama, openai and anthropic packages.

Under the template the model answers inside an open think block, so its whole answer is thinking; with think off the
template closes the block and the answer is content. With structured output the thinking grammar applies, and a
logit bias on `</` closes the block after one token: then both parts come back, the tags split across tokens."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest
from reasoning_model import REASONING_TEMPLATE, token_id

from localllm.chat.thinking import (
    Think,
    ThinkingSplitter,
    parse_think,
    supports_thinking,
    think_from_effort,
    thinking_grammar,
)
from localllm.errors import InvalidInput
from localllm.models.info import capabilities

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}},
}


# ---------------------------------------------------------------------------------------------------------- splitter


def split_all(pieces: list[str], *, opened: bool = False) -> tuple[str, str]:
    splitter = ThinkingSplitter(opened=opened)
    parts = [splitter.feed(piece) for piece in pieces] + [splitter.flush()]
    return "".join(p.thinking for p in parts), "".join(p.content for p in parts)


@pytest.mark.parametrize(
    "text, opened, expected",
    [
        (
            "\n<think>\nI should greet.\n</think>\n\nHello <think> there",
            False,
            ("I should greet.\n", "Hello <think> there"),
        ),
        ("Plain answer, no tags </think>", False, ("", "Plain answer, no tags </think>")),
        ("still thinking when cut", True, ("still thinking when cut", "")),
        ("\nweighing it</think>Answer.", True, ("weighing it", "Answer.")),
        ("<thin", False, ("", "<thin")),
        ("<think>half a tag </thi", False, ("half a tag </thi", "")),
    ],
)
def test_splitter_gives_the_same_parts_however_the_text_is_cut(text, opened, expected):
    assert split_all([text], opened=opened) == expected
    assert split_all(list(text), opened=opened) == expected  # one character at a time
    for cut in range(1, len(text)):
        for second in range(cut, len(text), 3):
            assert split_all([text[:cut], text[cut:second], text[second:]], opened=opened) == expected


def test_think_values():
    assert parse_think(None) == Think() and parse_think(True) == Think(enabled=True)
    assert parse_think("false") == Think(enabled=False) and parse_think("high") == Think(enabled=True, level="high")
    assert parse_think("low").template_variables() == {"enable_thinking": True, "reasoning_effort": "low"}
    with pytest.raises(InvalidInput, match="think 'loud'"):
        parse_think("loud")
    assert [think_from_effort(e) for e in (None, "none", "minimal", "medium")] == [None, False, "low", "medium"]
    with pytest.raises(InvalidInput, match="reasoning_effort"):
        think_from_effort("extreme")


def test_capabilities_from_the_template():
    assert supports_thinking(REASONING_TEMPLATE) and "thinking" in capabilities(REASONING_TEMPLATE)
    assert supports_thinking("{% if enable_thinking %}x{% endif %}")
    assert not supports_thinking("{{ messages[0].content }}") and not supports_thinking(None)
    assert capabilities("{{ messages[0].content }}") == ["completion"]


def test_thinking_grammar_parses():
    from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

    for opened in (True, False):
        grammar = thinking_grammar(JSON_GBNF, opened=opened)
        assert grammar.startswith("root ::= " + ("" if opened else '"<think>" '))
        LlamaGrammar.from_string(grammar, verbose=False)


# ---------------------------------------------------------------------------------------------------------- routes


@pytest.fixture(scope="module")
def reasoner(reasoner_path) -> str:
    return str(reasoner_path)


@pytest.fixture(scope="module")
def close_bias(reasoner) -> dict[int, float]:
    """A logit bias that makes the model close its think block as soon as the grammar lets it."""
    return {token_id(reasoner, "</"): 30.0}


def no_tags(*texts: str) -> bool:
    return not any("<think>" in t or "</think>" in t for t in texts)


@pytest.mark.models
def test_show_lists_thinking(base_url, reasoner):
    shown = ollama.Client(host=base_url).show(reasoner)
    assert "thinking" in shown.capabilities
    assert "thinking" not in ollama.Client(host=base_url).show("smollm2:135m").capabilities


@pytest.mark.models
def test_ollama_chat_thinking_streamed_and_not(base_url, reasoner):
    client = ollama.Client(host=base_url)
    options = {"temperature": 0, "num_predict": 24}
    whole = client.chat(model=reasoner, messages=QUESTION, options=options, think=True)
    assert whole.message.thinking and whole.message.content == "" and no_tags(whole.message.thinking)
    parts = list(client.chat(model=reasoner, messages=QUESTION, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == ""
    off = client.chat(model=reasoner, messages=QUESTION, options=options, think=False)
    assert off.message.content and not off.message.thinking and no_tags(off.message.content)


@pytest.mark.models
def test_ollama_thinking_then_structured_answer(base_url, reasoner, close_bias):
    client = ollama.Client(host=base_url)
    options = {"temperature": 0, "num_predict": 60, "logit_bias": close_bias}
    whole = client.chat(model=reasoner, messages=QUESTION, options=options, format=SCHEMA, think="high")
    assert whole.message.thinking.strip() and no_tags(whole.message.thinking, whole.message.content)
    assert set(json.loads(whole.message.content)) == {"city"}
    parts = list(
        client.chat(model=reasoner, messages=QUESTION, options=options, format=SCHEMA, think="high", stream=True)
    )
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == whole.message.content


@pytest.mark.models
def test_ollama_generate_thinking(base_url, reasoner, close_bias):
    client = ollama.Client(host=base_url)
    options = {"temperature": 0, "num_predict": 60, "logit_bias": close_bias}
    whole = client.generate(model=reasoner, prompt="Where is Paris?", options=options, format=SCHEMA, think=True)
    assert whole.thinking and json.loads(whole.response) and no_tags(whole.thinking, whole.response)
    parts = list(
        client.generate(
            model=reasoner, prompt="Where is Paris?", options=options, format=SCHEMA, think=True, stream=True
        )
    )
    assert "".join(p.thinking or "" for p in parts) == whole.thinking
    assert "".join(p.response for p in parts) == whole.response


@pytest.mark.models
def test_ollama_think_refused_where_it_cannot(base_url):
    client = ollama.Client(host=base_url)
    with pytest.raises(ollama.ResponseError, match='"smollm2:135m" does not support thinking') as caught:
        client.chat(model="smollm2:135m", messages=QUESTION, think=True)
    assert caught.value.status_code == 400
    assert client.chat(model="smollm2:135m", messages=QUESTION, think=False, options={"num_predict": 2}).done
    bad = httpx.post(base_url + "/api/chat", json={"model": "smollm2:135m", "messages": QUESTION, "think": "loud"})
    assert bad.status_code == 400 and "think" in bad.json()["error"]


@pytest.mark.models
def test_openai_reasoning_content(base_url, reasoner, close_bias):
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    whole = oai.chat.completions.create(
        model=reasoner,
        messages=QUESTION,
        temperature=0,
        max_tokens=60,
        reasoning_effort="low",
        logit_bias={str(k): v for k, v in close_bias.items()},
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    )
    message = whole.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and json.loads(message.content) and no_tags(thinking, message.content)
    chunks = list(
        oai.chat.completions.create(model=reasoner, messages=QUESTION, temperature=0, max_tokens=24, stream=True)
    )
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    plain = oai.chat.completions.create(model=reasoner, messages=QUESTION, temperature=0, max_tokens=24)
    assert streamed and streamed == plain.choices[0].message.model_extra["reasoning_content"]
    off = oai.chat.completions.create(
        model=reasoner, messages=QUESTION, temperature=0, max_tokens=24, reasoning_effort="none"
    )
    assert off.choices[0].message.content and "reasoning_content" not in (off.choices[0].message.model_extra or {})
    with pytest.raises(openai.BadRequestError, match="does not support thinking"):
        oai.chat.completions.create(model="smollm2:135m", messages=QUESTION, reasoning_effort="high")


@pytest.mark.models
def test_anthropic_thinking_blocks(base_url, reasoner):
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 16}
    whole = claude.messages.create(
        model=reasoner, max_tokens=24, messages=QUESTION, thinking=thinking, extra_body={"temperature": 0}
    )
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].signature
    assert no_tags(whole.content[0].thinking)
    with claude.messages.stream(
        model=reasoner, max_tokens=24, messages=QUESTION, thinking=thinking, extra_body={"temperature": 0}
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    streamed = "".join(e.thinking for e in events if e.type == "thinking")
    assert streamed == whole.content[0].thinking == final.content[0].thinking
    assert [e.type for e in events if e.type in ("signature", "content_block_stop")] == [
        "signature",
        "content_block_stop",
    ]
    off = claude.messages.create(
        model=reasoner, max_tokens=24, messages=QUESTION, thinking={"type": "disabled"}, extra_body={"temperature": 0}
    )
    assert [b.type for b in off.content] == ["text"] and off.content[0].text


@pytest.mark.models
def test_responses_reasoning_items(base_url, reasoner):
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    whole = oai.responses.create(
        model=reasoner,
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=24,
        reasoning={"effort": "medium"},
        store=False,
    )
    assert [item.type for item in whole.output] == ["reasoning"]
    text = whole.output[0].content[0].text
    assert text and no_tags(text)
    events = list(
        oai.responses.create(
            model=reasoner,
            input="What is the capital of France?",
            temperature=0,
            max_output_tokens=24,
            reasoning={"effort": "medium"},
            stream=True,
            store=False,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    assert "response.output_text.delta" not in kinds and events[-1].response.output[0].type == "reasoning"
    off = oai.responses.create(
        model=reasoner,
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=24,
        reasoning={"effort": "none"},
        store=False,
    )
    assert [item.type for item in off.output] == ["message"] and off.output_text
