"""The Modelfile parser and renderer: table-driven cases after Ollama's parser_test.go, plus our DRAFT."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from localllm import api
from localllm.errors import InvalidInput, ModelfileError
from localllm.models.modelfile import parse_modelfile, quote_value, render_modelfile

MODELFILES = sorted((Path(__file__).parent.parent / "modelfiles").glob("*"))


# ---------------------------------------------------------------------------------------------------------- parsing

PARSE_CASES = {
    "minimal": ("FROM smollm2:135m", {"from_": "smollm2:135m"}),
    "lower case instruction": ("from smollm2:135m", {"from_": "smollm2:135m"}),
    "mixed case instruction": ("FrOm ./models/x.gguf", {"from_": "./models/x.gguf"}),
    "comments and blank lines": ("# header\n\n   # indented comment\nFROM a\n\n", {"from_": "a"}),
    "indented instruction": ("   FROM a\n\tSYSTEM hi", {"from_": "a", "system": "hi"}),
    "unquoted value is stripped": ("FROM a\nSYSTEM   You are terse.   ", {"system": "You are terse."}),
    "hash inside a value is kept": ("FROM a\nSYSTEM You are #1", {"system": "You are #1"}),
    "quoted value": ('FROM a\nSYSTEM "  padded  "', {"system": "  padded  "}),
    "empty quoted value": ('FROM a\nSYSTEM ""', {"system": ""}),
    "triple-quoted value spans lines": (
        'FROM a\nTEMPLATE """{{ .System }}\n  {{ .Prompt }}\n"""',
        {"template": "{{ .System }}\n  {{ .Prompt }}\n"},
    ),
    "triple-quoted value keeps quotes": ('FROM a\nSYSTEM """Say "hi" and 3"""', {"system": 'Say "hi" and 3'}),
    "triple-quoted value keeps blanks at line ends": ('FROM a\nSYSTEM """one  \ntwo"""', {"system": "one  \ntwo"}),
    "comment-like line inside a value": (
        'FROM a\nSYSTEM """line\n# not a comment\n"""',
        {"system": "line\n# not a comment\n"},
    ),
    "double-quoted value spans lines": ('FROM a\nSYSTEM "one\ntwo"', {"system": "one\ntwo"}),
    "CRLF line endings": ('FROM a\r\nSYSTEM """x\r\ny"""\r\n', {"from_": "a", "system": "x\ny"}),
    "byte order mark": ("\ufeffFROM a", {"from_": "a"}),
    "stop accumulates": (
        'FROM a\nPARAMETER stop "<|im_end|>"\nPARAMETER stop <|im_start|>',
        {"parameters": {"stop": ["<|im_end|>", "<|im_start|>"]}},
    ),
    "typed parameters": (
        "FROM a\nPARAMETER temperature 0.2\nPARAMETER num_ctx 4096\nPARAMETER flash_attn true\n"
        "PARAMETER kv_type q8_0\nPARAMETER seed -1",
        {"parameters": {"temperature": 0.2, "num_ctx": 4096, "flash_attn": True, "kv_type": "q8_0", "seed": -1}},
    ),
    "a later PARAMETER wins": ("FROM a\nPARAMETER top_k 10\nPARAMETER top_k 20", {"parameters": {"top_k": 20}}),
    "messages": (
        'FROM a\nMESSAGE system Be brief.\nMESSAGE user "Hi?"\nMESSAGE assistant """Hello\nthere"""',
        {
            "messages": [
                api.Message(role="system", content="Be brief."),
                api.Message(role="user", content="Hi?"),
                api.Message(role="assistant", content="Hello\nthere"),
            ]
        },
    ),
    "one license is a string": ("FROM a\nLICENSE MIT", {"license": "MIT"}),
    "repeated licenses are a list": (
        'FROM a\nLICENSE MIT\nLICENSE """Apache\n2.0"""',
        {"license": ["MIT", "Apache\n2.0"]},
    ),
    "adapters": (
        "FROM a\nADAPTER ./lora.gguf\nADAPTER ./other.gguf",
        {"adapters": {"./lora.gguf": "", "./other.gguf": ""}},
    ),
    "an adapter's scale": (
        "FROM a\nADAPTER ./lora.gguf 0.5\nADAPTER ./my lora.gguf\nADAPTER ./off.gguf 0",
        {
            "adapters": {"./lora.gguf": "", "./my lora.gguf": "", "./off.gguf": ""},
            "adapter_scales": {"./lora.gguf": 0.5, "./off.gguf": 0.0},
        },
    ),
    "draft": ("FROM gemma3:4b\nDRAFT gemma3:270m", {"from_": "gemma3:4b", "draft": "gemma3:270m"}),
    "quoted path with spaces": ('FROM "/models/my model.gguf"', {"from_": "/models/my model.gguf"}),
    "REQUIRES is accepted and skipped": ("FROM a\nREQUIRES 0.14.0", {"from_": "a", "parameters": {}}),
    "nothing else is set": (
        "FROM a",
        {
            "template": None,
            "system": None,
            "license": None,
            "draft": None,
            "messages": [],
            "parameters": {},
            "adapters": {},
            "model": "",
        },
    ),
}


def test_an_adapter_scale_out_of_range_names_the_line():
    with pytest.raises(ModelfileError, match="line 2: ADAPTER scale 99"):
        parse_modelfile("FROM a\nADAPTER ./lora.gguf 99")


def test_adapter_scales_round_trip():
    text = render_modelfile(from_="a", adapters=["./a.gguf", "./b.gguf"], adapter_scales={"./b.gguf": 0.25})
    parsed = parse_modelfile(text)
    assert parsed.adapter_scales == {"./b.gguf": 0.25} and list(parsed.adapters) == ["./a.gguf", "./b.gguf"]


@pytest.mark.parametrize("text,expected", PARSE_CASES.values(), ids=PARSE_CASES.keys())
def test_parse(text, expected):
    request = parse_modelfile(text)
    assert isinstance(request, api.CreateRequest)
    for name, value in expected.items():
        assert getattr(request, name) == value, name


# Every Ollama PARAMETER name, and each of ours, with a value and the typed result.
PARAMETER_CASES = [
    ("num_ctx", "8192", 8192),
    ("temperature", "0.7", 0.7),
    ("top_k", "40", 40),
    ("top_p", "0.95", 0.95),
    ("min_p", "0.05", 0.05),
    ("typical_p", "1", 1.0),
    ("repeat_penalty", "1.1", 1.1),
    ("repeat_last_n", "-1", -1),
    ("presence_penalty", "0.5", 0.5),
    ("frequency_penalty", "-0.5", -0.5),
    ("seed", "42", 42),
    ("stop", "</s>", ["</s>"]),
    ("num_predict", "128", 128),
    ("num_gpu", "0", 0),
    ("num_thread", "2", 2),
    ("num_batch", "256", 256),
    ("num_parallel", "4", 4),
    ("kv_type", "q4_0", "q4_0"),
    ("flash_attn", "false", False),
    ("backend", "llama.cpp", "llama.cpp"),
    ("spec_type", "ngram", "ngram"),
    ("spec_max_draft", "8", 8),
]


@pytest.mark.parametrize("name,value,typed", PARAMETER_CASES, ids=[case[0] for case in PARAMETER_CASES])
def test_parameter_names_and_types(name, value, typed):
    parameters = parse_modelfile(f"FROM a\nPARAMETER {name} {value}").parameters
    assert parameters == {name: typed}
    assert type(parameters[name]) is type(typed)


def test_ollama_only_parameter_is_dropped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="localllm.models.modelfile"):
        request = parse_modelfile("FROM a\nPARAMETER mirostat 1\nPARAMETER top_k 5")
    assert request.parameters == {"top_k": 5}
    assert "line 2" in caplog.text and "mirostat" in caplog.text


def test_parameters_split_into_load_and_sampling_options():
    request = parse_modelfile("FROM a\nPARAMETER num_ctx 2048\nPARAMETER temperature 0\nPARAMETER stop x")
    load, sampling = api.split_options(request.parameters)
    assert api.LoadOptions(**load).num_ctx == 2048
    assert api.SamplingOptions(**sampling).temperature == 0.0
    assert api.SamplingOptions(**sampling).stop == ["x"]


# ---------------------------------------------------------------------------------------------------------- errors

ERROR_CASES = {
    "empty file": ("", 1, "no FROM line"),
    "only comments": ("# nothing\n# here\n", 1, "no FROM line"),
    "no FROM": ("SYSTEM hi\nPARAMETER top_k 1", 1, "no FROM line"),
    "unknown instruction": ("FROM a\nFOO bar", 2, "unknown instruction 'FOO'; expected one of FROM, PARAMETER"),
    "punctuation in instruction": ("FROM: a", 1, "unknown instruction 'FROM:'"),
    "Ollama renderer": ("FROM a\n\nRENDERER qwen3", 3, "RENDERER names a renderer built into Ollama"),
    "misspelt parameter": (
        "FROM a\nPARAMETER temprature 0.1",
        2,
        "unknown parameter 'temprature'; did you mean 'temperature'?",
    ),
    "unknown parameter": (
        "FROM a\nPARAMETER zzz 1",
        2,
        "unknown parameter 'zzz'; known parameters: adapter_scale, backend",
    ),
    "not an integer": ("FROM a\nPARAMETER num_ctx abc", 2, "parameter num_ctx 'abc': input should be a valid integer"),
    "integer out of range": (
        "FROM a\nPARAMETER num_ctx 4",
        2,
        "parameter num_ctx '4': input should be greater than or equal to 16",
    ),
    "float for an integer": ("FROM a\nPARAMETER seed 1.5", 2, "parameter seed '1.5'"),
    "not a number": (
        "FROM a\nPARAMETER temperature hot",
        2,
        "parameter temperature 'hot': input should be a valid number",
    ),
    "not a boolean": (
        "FROM a\nPARAMETER flash_attn maybe",
        2,
        "parameter flash_attn 'maybe': input should be a valid boolean",
    ),
    "not a choice": (
        "FROM a\nPARAMETER kv_type q5",
        2,
        "parameter kv_type 'q5': input should be 'f16', 'q8_0' or 'q4_0'",
    ),
    "PARAMETER without a value": ("FROM a\nPARAMETER seed", 2, "PARAMETER seed needs a value"),
    "PARAMETER alone": ("FROM a\nPARAMETER", 2, "PARAMETER needs a name and a value"),
    "instruction without a value": ("FROM a\nSYSTEM", 2, "SYSTEM needs a value"),
    "FROM without a value": ("FROM", 1, "FROM needs a value"),
    "bad MESSAGE role": ("FROM a\nMESSAGE bot hello", 2, "MESSAGE role 'bot' must be one of system, user, assistant"),
    "MESSAGE role is case-sensitive": ("FROM a\nMESSAGE User hello", 2, "MESSAGE role 'User'"),
    "MESSAGE without text": ("FROM a\nMESSAGE user", 2, "MESSAGE user needs a text"),
    "unterminated triple quote": (
        'FROM a\nPARAMETER top_k 1\nSYSTEM """You are\nhelpful',
        3,
        'unterminated """ in SYSTEM',
    ),
    "unterminated quote": ('FROM a\nSYSTEM "You are', 2, 'unterminated " in SYSTEM'),
    "unterminated MESSAGE": ('FROM a\nMESSAGE user """hi', 2, 'unterminated """ in MESSAGE'),
    "triple quote closed mid-line": ('FROM a\nSYSTEM """hi""" there', 2, 'unterminated """'),
    # A second FROM is a vision projector (issue 31); a third has no meaning.
    "FROM three times": ("FROM a\n# again\nFROM b\nFROM c", 4, "FROM given three times (lines 1 and 3)"),
    "SYSTEM twice": ("FROM a\nSYSTEM x\nSYSTEM y", 3, "SYSTEM given twice (first on line 2)"),
    "error after a multi-line value": (
        'FROM a\nSYSTEM """x\ny\nz"""\nPARAMETER top_k many',
        5,
        "parameter top_k 'many'",
    ),
}


@pytest.mark.parametrize("text,line,message", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_parse_error_names_the_line(text, line, message):
    with pytest.raises(ModelfileError) as caught:
        parse_modelfile(text)
    assert caught.value.line == line
    assert str(caught.value).startswith(f"Modelfile line {line}: ")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------------------------------- rendering

ROUND_TRIP_CASES = {
    "minimal": {"from_": "smollm2:135m"},
    "everything": {
        "from_": "./my model.gguf",
        "template": "{{ .System }}\n{{ .Prompt }}",
        "system": "Be brief.",
        "parameters": {"temperature": 0.1, "num_ctx": 4096, "flash_attn": False, "stop": ["<|im_end|>", "\n\n"]},
        "messages": [api.Message(role="user", content="Hi"), api.Message(role="assistant", content="")],
        "license": ["MIT", "line one\nline two"],
        "draft": "gemma3:270m",
        "adapters": {"./lora.gguf": ""},
    },
    "leading and trailing blanks": {"from_": "a", "system": "  padded\t"},
    "quotes inside": {"from_": "a", "system": 'say "hi"', "template": '"starts with a quote'},
    "only a quote": {"from_": "a", "system": '"', "parameters": {"stop": ['"', '"""', "'"]}},
    "multi-line with quotes": {"from_": "a", "system": 'one "two"\nthree "four"'},
    "hash at line start inside a value": {"from_": "a", "system": "# heading\ntext"},
    "empty strings": {"from_": "a", "system": "", "template": "", "license": ""},
    "single license": {"from_": "a", "license": "Apache-2.0"},
}


@pytest.mark.parametrize("fields", ROUND_TRIP_CASES.values(), ids=ROUND_TRIP_CASES.keys())
def test_render_round_trips(fields):
    text = render_modelfile(**fields)
    request = parse_modelfile(text)
    for name, value in fields.items():
        assert getattr(request, name) == value, f"{name} in:\n{text}"


def test_render_takes_dict_messages_and_adapter_lists():
    text = render_modelfile(from_="a", messages=[{"role": "user", "content": "hi"}], adapters=["./x.gguf"])
    request = parse_modelfile(text)
    assert request.messages == [api.Message(role="user", content="hi")]
    assert request.adapters == {"./x.gguf": ""}


def test_render_normalises_line_endings():
    assert parse_modelfile(render_modelfile(from_="a", system="x\r\ny\rz")).system == "x\ny\nz"


@pytest.mark.parametrize("value", ['first line ends """\nsecond', '""""""\nx'])
def test_unwritable_value_is_a_clear_error(value):
    with pytest.raises(InvalidInput, match="cannot be written in a Modelfile"):
        quote_value(value, what="SYSTEM")


@pytest.mark.parametrize(
    "text,quoted",
    [
        ("plain", "plain"),
        ("two words", "two words"),
        ("", '""'),
        (" x", '" x"'),
        ("a\nb", '"a\nb"'),
        ('a "b"\nc', '"""a "b"\nc"""'),
    ],
)
def test_quote_value_quotes_only_when_needed(text, quoted):
    assert quote_value(text) == quoted


# ---------------------------------------------------------------------------------------------------------- examples


def test_modelfiles_folder_has_examples():
    assert len(MODELFILES) >= 3


@pytest.mark.parametrize("path", MODELFILES, ids=[path.name for path in MODELFILES])
def test_example_modelfile_parses_and_round_trips(path):
    text = path.read_text()
    assert text.startswith("#"), "each example starts with a comment header saying what it is"
    request = parse_modelfile(text)
    assert request.from_
    again = parse_modelfile(
        render_modelfile(
            from_=request.from_,
            template=request.template,
            system=request.system,
            parameters=request.parameters,
            messages=request.messages,
            license=request.license,
            draft=request.draft,
            adapters=request.adapters,
        )
    )
    assert again == request


def test_draft_example_names_a_draft_and_speculation():
    request = parse_modelfile((Path(__file__).parent.parent / "modelfiles" / "gemma3-drafted.Modelfile").read_text())
    assert request.draft == "gemma3:270m"
    assert request.parameters["spec_type"] == "draft"
    coder = parse_modelfile(
        (Path(__file__).parent.parent / "modelfiles" / "qwen2.5-coder-drafted.Modelfile").read_text()
    )
    assert (coder.from_, coder.draft) == ("qwen2.5-coder:1.5b", "qwen2.5-coder:0.5b")
    assert coder.parameters["spec_type"] == "draft"
