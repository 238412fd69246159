"""JSON schemas are bounded before any grammar is built (issue 34), and the grammars they become allow valid JSON
only (issue 30): every route that takes a schema, against the real server and model, plus a bounded fuzz that
measures the server's memory."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_harness import private_home, served

from localllm.api import LoadOptions, Tool, ToolFunction
from localllm.backends.llama_cpp.backend import LlamaCppBackend
from localllm.chat.schema_grammar import MAX_REPEAT, schema_grammar
from localllm.chat.structured import tool_choice_grammar
from localllm.errors import InvalidInput

MODEL = "smollm2:135m"
ARRAY_BOMB = {"type": "array", "items": {"type": "string"}, "minItems": 1_000_000_000}
STRING_BOMB = {"type": "string", "minLength": 100_000_000}
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

# ---------------------------------------------------------------------------------------------------------- grammar


def deep_properties(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "schema, named",
    [
        (ARRAY_BOMB, "schema.minItems 1000000000 is over the bound of 2000"),
        (STRING_BOMB, "schema.minLength 100000000 is over the bound of 2000"),
        ({"type": "array", "maxItems": 2**63}, "maxItems"),
        ({"type": "string", "maxLength": -1}, "non-negative integer"),
        ({"type": "string", "maxLength": 1.5}, "non-negative integer"),
        ({"type": "string", "pattern": "^a{5000}$"}, "pattern repeats {5000}"),
        # llama.cpp's parser counts max - min unsigned: min above max never ended
        ({"type": "array", "minItems": 5, "maxItems": 3}, "minItems 5 is more than maxItems 3"),
        ({"type": "string", "minLength": 2, "maxLength": 1}, "minLength 2 is more than maxLength 1"),
        ({"type": "string", "pattern": "^a{5,3}$"}, "its minimum is more than its maximum"),
        ({"enum": list(range(1001))}, "enum has 1001 values"),
        ({"type": "object", "properties": {f"p{i}": {} for i in range(1001)}}, "1001 properties"),
        (deep_properties(40), "nests deeper than 32"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 2000} for i in range(60)}},
            "add up to",
        ),
    ],
)
def test_schema_past_a_bound_is_refused_naming_the_bound(schema, named):
    with pytest.raises(InvalidInput) as refused:
        schema_grammar(schema)
    assert named in str(refused.value)


def test_repetition_is_written_as_gbnf_ranges_not_item_by_item():
    grammar = schema_grammar({"type": "array", "items": {"type": "string", "maxLength": MAX_REPEAT}, "minItems": 3})
    assert f"char{{0,{MAX_REPEAT}}}" in grammar and "item-next{2,}" in grammar
    assert len(grammar) < 1000


# Claude Code's Workflow tool: a size bound that only a grammar would need, on a tool the model may never call.
WORKFLOW = {
    "type": "function",
    "function": {
        "name": "Workflow",
        "parameters": {
            "type": "object",
            "properties": {"script": {"type": "string", "maxLength": 524288}, "steps": {"type": "array"}},
            "required": ["script"],
        },
    },
}


def test_a_tool_list_is_not_refused_for_a_bound_only_a_grammar_needs():
    tools = [Tool(type="function", function=ToolFunction(**spec["function"])) for spec in (PYTHON, WORKFLOW)]
    assert tool_choice_grammar(tools, "auto") is None
    forced = tool_choice_grammar(tools, {"type": "function", "function": {"name": "Workflow"}})
    assert forced is not None and "524288" not in forced  # the grammar leaves the string's length open
    with pytest.raises(InvalidInput, match="maxLength 524288 is over the bound of 2000"):
        schema_grammar(WORKFLOW["function"]["parameters"])  # a response format is still held to the bound


def test_a_tool_list_is_still_held_to_the_size_bounds():
    tools = [Tool(type="function", function=ToolFunction(name="deep", parameters=deep_properties(40)))]
    with pytest.raises(InvalidInput, match="nests deeper than 32"):
        tool_choice_grammar(tools, "auto")


@pytest.fixture(scope="module", params=["llama.cpp", pytest.param("mlx", marks=pytest.mark.mlx)])
def smollm2(smollm2_path: Path, request):
    """smollm2 on each backend, whose grammars hold the same GBNF."""
    if request.param == "llama.cpp":
        model = LlamaCppBackend().load(smollm2_path, LoadOptions(num_ctx=64, num_parallel=1))
    else:
        pytest.importorskip("llguidance")
        from localllm.backends.mlx import MlxBackend

        model = MlxBackend().load(request.getfixturevalue("smollm2_mlx"), LoadOptions(num_ctx=64, num_parallel=1))
    yield model
    model.close()


def grammar_allows(model, grammar: str, prefix: str, more: str) -> bool:
    """Whether the grammar, after the tokens of `prefix`, allows the tokens of `more`."""
    probe = model.grammars.probe(grammar)
    try:
        head = model.tokenize(prefix, add_special=False)
        assert probe.allowed([], head) == len(head), f"the grammar refuses {prefix!r} itself"
        tail = model.tokenize(more, add_special=False)
        return probe.allowed(head, tail) == len(tail)
    finally:
        probe.close()


@pytest.mark.models
def test_forced_call_grammar_allows_only_valid_json_strings(smollm2):
    tools = [Tool(type="function", function=ToolFunction(**PYTHON["function"]))]
    grammar = tool_choice_grammar(tools, "required")
    assert grammar is not None
    prefix = '{"name": "python", "arguments": {"code": "print(1)'
    assert grammar_allows(smollm2, grammar, prefix, "\\nprint(2)")  # JSON's escape
    assert not grammar_allows(smollm2, grammar, prefix, "\n")  # a raw newline: invalid JSON
    assert not grammar_allows(smollm2, grammar, prefix, "\t")


@pytest.mark.models
@pytest.mark.parametrize("schema", [{"type": "object"}, {"type": "string", "maxLength": 40}])
def test_schema_grammar_strings_refuse_control_characters(smollm2, schema):
    grammar = schema_grammar({"type": "object", "properties": {"v": schema}, "required": ["v"]})
    prefix = '{"v": {"k": "a' if schema["type"] == "object" else '{"v": "a'
    assert grammar_allows(smollm2, grammar, prefix, "b")
    assert not grammar_allows(smollm2, grammar, prefix, "\n")


# ---------------------------------------------------------------------------------------------------------- routes


@pytest.fixture(scope="module")
def base_url(models_home, tmp_path_factory):
    home = private_home(models_home, tmp_path_factory.mktemp("schemas"))
    with served(home, LOCALLLM_CONTEXT_LENGTH="512", LOCALLLM_NUM_PARALLEL="1", LOCALLLM_HOME=str(home)) as url:
        yield url


def route_bodies(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    """One request per route that takes a schema, each carrying `schema`."""
    chat = [{"role": "user", "content": "Answer in JSON."}]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return [
        ("/api/chat", {"model": MODEL, "messages": chat, "format": schema, "stream": False, "options": TINY}),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": chat,
                "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": chat, "max_tokens": 2, "tools": [tool], "tool_choice": "required"},
        ),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": chat,
                "output_format": {"type": "json_schema", "schema": schema},
            },
        ),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": chat,
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            },
        ),
        (
            "/v1/responses",
            {
                "model": MODEL,
                "input": "Answer in JSON.",
                "max_output_tokens": 16,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
        ),
    ]


TINY = {"temperature": 0, "num_predict": 2}


def message_of(response: httpx.Response) -> str:
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


def assert_still_answers(url: str) -> None:
    plain = httpx.post(
        url + "/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False, "options": TINY}, timeout=120
    )
    assert plain.status_code == 200 and plain.json()["done"], plain.text


@pytest.mark.models
@pytest.mark.parametrize("schema, bound", [(ARRAY_BOMB, "minItems 1000000000"), (STRING_BOMB, "minLength 100000000")])
def test_schema_bombs_are_400_naming_the_bound_on_every_route(base_url, schema, bound):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for path, body in route_bodies(schema):
            refused = http.post(path, json=body)
            assert refused.status_code == 400, (path, refused.text)
            assert bound in message_of(refused) and "2000" in message_of(refused), (path, refused.text)
    assert_still_answers(base_url)


@pytest.mark.models
def test_a_tool_with_an_agents_size_bound_is_accepted_on_the_routes(base_url):
    anthropic_tool = {"name": "Workflow", "input_schema": WORKFLOW["function"]["parameters"]}
    chat = [{"role": "user", "content": "Hi"}]
    bodies = [
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 2, "tools": [WORKFLOW]}),
        ("/v1/messages", {"model": MODEL, "messages": chat, "max_tokens": 2, "tools": [anthropic_tool]}),
    ]
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for path, body in bodies:
            answered = http.post(path, json=body)
            assert answered.status_code == 200, (path, answered.text)


@pytest.mark.models
@pytest.mark.parametrize("fmt", [["json_schema"], "json_schema", 7])
def test_output_config_format_of_the_wrong_type_is_400(base_url, fmt):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    refused = httpx.post(base_url + "/v1/messages", json=body | {"output_config": {"format": fmt}}, timeout=60)
    assert refused.status_code == 400, refused.text
    assert "output_config.format" in message_of(refused)
    for path, wrong in [
        ("/v1/responses", {"model": MODEL, "input": "Hi", "text": {"format": fmt}}),
        ("/v1/chat/completions", body | {"response_format": {"type": "json_schema", "json_schema": fmt}}),
    ]:
        refused = httpx.post(base_url + path, json=wrong, timeout=60)
        assert refused.status_code == 400, (path, refused.text)
    assert_still_answers(base_url)


@pytest.mark.models
def test_forced_python_call_is_valid_json_or_a_cut_off_call(base_url):
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Write a Python program of five lines that prints the first primes."}]
    whole = oai.chat.completions.create(
        model=MODEL, messages=ask, tools=[PYTHON], tool_choice="required", max_tokens=160, temperature=0
    )
    choice = whole.choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "python"
    if choice.finish_reason == "tool_calls":
        assert "code" in json.loads(call.function.arguments)
    else:
        assert choice.finish_reason == "length"
    cut = oai.chat.completions.create(
        model=MODEL, messages=ask, tools=[PYTHON], tool_choice="required", max_tokens=12, temperature=0
    )
    assert cut.choices[0].finish_reason == "length"
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    anthropic_tool = {
        "name": "python",
        "description": "Run Python code.",
        "input_schema": PYTHON["function"]["parameters"],
    }
    for max_tokens, stop in ((160, None), (12, "max_tokens")):
        reply = claude.messages.create(
            model=MODEL, max_tokens=max_tokens, messages=ask, tools=[anthropic_tool], tool_choice={"type": "any"}
        )
        assert reply.stop_reason in ((stop,) if stop else ("tool_use", "max_tokens")), reply
        if reply.stop_reason == "tool_use":
            assert isinstance(reply.content[-1].input.get("code"), str)


# ---------------------------------------------------------------------------------------------------------- fuzz

SEED = 34
FUZZ_SCHEMAS = 50  # each sent to all six schema routes: 300 requests
COUNTS: list[Any] = [0, 1, 3, MAX_REPEAT, MAX_REPEAT + 1, 10**9, 2**63, -1, 1.5, "7", None, True]
MEMORY_BOUND = 512 * 2**20  # the server's peak RSS may grow this much over the whole fuzz


def fuzz_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A schema with extreme bounds, nested at random (bounded), from the seeded `rng`."""
    kind = rng.choice(["array", "string", "object", "enum", "pattern", "union"] if depth < 6 else ["string"])
    if kind == "array":
        return {"type": "array", "items": fuzz_schema(rng, depth + 1)} | counts(rng, "minItems", "maxItems")
    if kind == "string":
        return {"type": "string"} | counts(rng, "minLength", "maxLength")
    if kind == "object":
        n = rng.choice([0, 2, 5, 1001])
        props = {f"p{i}": fuzz_schema(rng, depth + 1) if i < 3 else {"type": "integer"} for i in range(n)}
        return {"type": "object", "properties": props, "required": sorted(props)[: rng.randint(0, 2)]}
    if kind == "enum":
        return {"enum": list(range(rng.choice([1, 5, 1001])))}
    if kind == "pattern":
        low, high = rng.choice(COUNTS[:6]), rng.choice(COUNTS[:6])
        return {"type": "string", "pattern": f"^(ab|c){{{low},{high}}}x{{{high}}}$"}
    return {"anyOf": [fuzz_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}


def counts(rng: random.Random, low: str, high: str) -> dict[str, Any]:
    return {key: rng.choice(COUNTS) for key in (low, high) if rng.random() < 0.6}


def peak_rss_growth_start() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident size, to the current one


def peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@pytest.mark.models
def test_fuzzed_schemas_on_every_route_never_5xx_nor_grow_the_server(base_url):
    # The server runs in this process (served: a thread), so its peak RSS is this process's VmHWM.
    assert_still_answers(base_url)  # the model is loaded before the measure starts
    rng = random.Random(SEED)
    schemas = [fuzz_schema(rng) for _ in range(FUZZ_SCHEMAS)]
    before = (peak_rss_growth_start(), peak_rss())[1]
    failures, statuses = [], set()
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for schema in schemas:
            for path, body in route_bodies(schema):
                response = http.post(path, json=body)
                statuses.add(response.status_code)
                if response.status_code >= 500:
                    failures.append(
                        f"{path} {json.dumps(schema)[:200]} -> {response.status_code} {response.text[:200]}"
                    )
    growth = peak_rss() - before
    assert not failures, "\n".join(failures)
    assert {200, 400} <= statuses  # both bounded-and-built and refused schemas were sent
    assert growth < MEMORY_BOUND, f"peak RSS grew {growth / 2**20:.0f} MiB over the fuzz"
    assert_still_answers(base_url)
