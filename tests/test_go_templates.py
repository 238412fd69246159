"""Ollama's Go chat templates (Modelfile TEMPLATE) are translated into sandboxed Jinja and render as Ollama renders
them; what lies outside the subset is refused with the construct named."""

from __future__ import annotations

import pytest

from localllm.chat.go_templates import is_go_template
from localllm.chat.templates import render_chat, validate_template
from localllm.errors import InvalidInput

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]

# Ollama's ChatML template: one pass over .Messages.
CHATML = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

# The older form: run once per turn with .System/.Prompt/.Response; the prompt ends at the last {{ .Response }}.
LEGACY = """{{ if .System }}<|system|>
{{ .System }}</s>
{{ end }}{{ if .Prompt }}<|user|>
{{ .Prompt }}</s>
{{ end }}<|assistant|>
{{ .Response }}</s>
"""

# Variables, slice/len/eq/and, else-if chains and `$` from inside a range (Ollama's gemma3 template does this).
LAST_TURN = """{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}[U{{ $i }}{{ if and (eq $i 1) $.System }} ({{ $.System }}){{ end }}] {{ .Content }}
{{ else if eq .Role "assistant" }}[A] {{ .Content }}
{{ end }}
{{- if $last }}[A]{{ end }}
{{- end }}"""

TOOLS = """{{- if .Tools }}Tools: {{ range .Tools }}{{ .Function.Name }}={{ json .Function.Parameters }} {{ end }}
{{ end }}
{{- range .Messages }}{{ .Role }}: {{ .Content }}
{{- range .ToolCalls }} call {{ .Function.Name }}{{ .Function.Arguments }}{{ end }}
{{ end }}"""


def test_messages_template_renders_the_conversation():
    assert render_chat(CHATML, CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def test_legacy_template_runs_per_turn_and_stops_at_the_last_response():
    assert render_chat(LEGACY, CONVERSATION) == (
        "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n<|user|>\nBye</s>\n<|assistant|>\n"
    )


def test_variables_slices_and_root_access():
    assert render_chat(LAST_TURN, CONVERSATION) == "[U1 (Be brief.)] Hi\n[A] Hello!\n[U3] Bye\n[A]"


def test_tools_and_tool_calls_print_as_json():
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "required": ["city"]},
        },
    }
    messages = [
        {"role": "user", "content": "Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
        },
    ]
    out = render_chat(TOOLS, messages, tools=[tool])
    assert out == (
        'Tools: get_weather={"type": "object", "required": ["city"]} \n'
        'user: Rome?\nassistant:  call get_weather{"city": "Rome"}\n'
    )
    assert render_chat(TOOLS, messages) == 'user: Rome?\nassistant:  call get_weather{"city": "Rome"}\n'


def test_text_that_looks_like_jinja_stays_text():
    template = "{% endraw %}{% if x %}{# c #} }} {{ .Prompt }}"
    assert (
        render_chat(template, [{"role": "user", "content": "{{ 7*7 }}"}])
        == "{% endraw %}{% if x %}{# c #} }} {{ 7*7 }}"
    )


def test_reassignment_printf_and_continue():
    template = (
        '{{- $s := "" }}{{- range .Messages }}{{ if eq .Role "system" }}{{ $s = printf "%s[%s]" $s .Content }}'
        "{{ continue }}{{ end }}{{ .Content }};{{ end }}{{ $s }}"
    )
    assert render_chat(template, CONVERSATION) == "Hi;Hello!;Bye;[Be brief.]"


@pytest.mark.parametrize(
    "template, construct",
    [
        ('{{ define "x" }}y{{ end }}{{ .Prompt }}', "{{ define }}"),
        ("{{ with .System }}{{ . }}{{ end }}", "{{ with }}"),
        ('{{ template "x" . }}{{ .Prompt }}', "{{ template }}"),
        ("{{ range .Tools }}{{ toTypeScriptType .Function }}{{ end }}{{ .Prompt }}", "'toTypeScriptType'"),
        ("{{ if .System }}{{ .System }}", "without its {{ end }}"),
    ],
)
def test_constructs_outside_the_subset_are_refused_by_name(template, construct):
    assert is_go_template(template)
    with pytest.raises(InvalidInput, match="cannot translate|without") as info:
        validate_template(template)
    assert construct in str(info.value)


def test_go_templates_stay_in_the_sandbox():
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidInput):
        render_chat("{{ range .Messages }}{{ .__class__.__init__.__globals__ }}{{ end }}", messages)
    assert messages == [{"role": "user", "content": "Hi"}]
