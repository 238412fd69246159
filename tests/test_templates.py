"""Chat templates render in jinja2's sandbox: real templates work, hostile ones fail safely."""

from __future__ import annotations

import pytest

from localllm.chat.templates import PLAIN_TEMPLATE, render_chat
from localllm.errors import InvalidInput

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chatml_renders_with_generation_prompt():
    out = render_chat(CHATML, [{"role": "user", "content": "Hi"}])
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_sees_tools_bos_and_helpers():
    template = "{{ bos_token }}{{ tools | tojson }}{% if not messages %}{{ raise_exception('no messages') }}{% endif %}"
    out = render_chat(template, [{"role": "user", "content": "x"}], tools=[{"name": "f"}], bos_token="<s>")
    assert out == '<s>[{"name": "f"}]'
    with pytest.raises(InvalidInput, match="no messages"):
        render_chat(template, [], tools=[{"name": "f"}])


def test_model_without_template_gets_a_plain_transcript():
    out = render_chat(None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert out == "Be brief.\n\nUser: Hi\nAssistant:"
    assert render_chat(PLAIN_TEMPLATE, [{"role": "user", "content": "Hi"}]) == "User: Hi\nAssistant:"


@pytest.mark.parametrize(
    "hostile",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages | length }}",
        "{{ messages[0].update({'content': 'changed'}) }}",
    ],
)
def test_hostile_template_fails_safely(hostile):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidInput):
        render_chat(hostile, messages)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_broken_template_is_a_clear_error():
    with pytest.raises(InvalidInput, match="does not parse"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "Hi"}])


def test_ollama_go_template_is_translated():
    out = render_chat("{{ if .System }}{{ .System }}\n{{ end }}{{ .Prompt }}", [{"role": "user", "content": "Hi"}])
    assert out == "Hi"


@pytest.mark.parametrize(
    "costly, words",
    [
        ("{{ 'a' * 400000000 }}", "repetition"),  # grew the server to 8 GB before
        ("{% for i in range(100000) %}{{ range(100000) | map('string') | join | length }}{% endfor %}", "stopped"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "stopped"),
        ("{{ '%0999999999d' % 1 }}", "format width"),
        ("{{ '{:999999999}'.format(1) }}", "format width"),
        ("{{ 'x' | center(999999999) }}", "999999999"),
        ("{{ ('\n' * 1000000) | indent(1000000) }}", "indent"),
        ("{{ range(100000) | map('string') | join('x' * 1000000) }}", "join"),
        ("{{ 2 ** 10000000 }}", "power"),
        ("{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
        ("{% for i in range(1000000) %}{% endfor %}", "Range too big"),
        ("{{ 1 / 0 }}", "division by zero"),
    ],
)
def test_costly_or_failing_templates_are_invalid_input(costly, words, monkeypatch):
    if words != "stopped":  # a bound of its own must stop it, not the clock (which a busy machine reaches first)
        from localllm.chat import sandbox

        monkeypatch.setattr(sandbox, "MAX_SECONDS", 600.0)
    with pytest.raises(InvalidInput, match=words):
        render_chat(costly, [{"role": "user", "content": "Hi"}])


def test_nested_loops_stop_at_the_step_bound_on_any_machine(monkeypatch):
    # The step bound, not the clock, must stop this: on a busy machine the 5 s deadline came first and the
    # verdict depended on the load, so the deadline is moved out of the way here.
    from localllm.chat import sandbox

    monkeypatch.setattr(sandbox, "MAX_SECONDS", 600.0)
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(InvalidInput, match="steps"):
        render_chat(nested, [{"role": "user", "content": "Hi"}])


def test_a_render_stops_when_its_request_is_cancelled():
    from localllm.errors import Cancelled

    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(Cancelled):
        render_chat(nested, [], cancelled=lambda: True)


def test_real_templates_render_within_the_bounds():
    long_chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello " * 50} for i in range(400)]
    out = render_chat(CHATML, long_chat)
    assert out.count("<|im_start|>") == 401
    assert render_chat(
        "{{ messages | tojson(indent=2) }}{{ [1, 2] | join(',') }}{{ '%5.2f' | format(1.5) }}",
        [{"role": "user", "content": "Hi"}],
    ).endswith("1,2 1.50")


def test_go_templates_render_in_the_same_bounded_sandbox():
    from localllm.errors import Cancelled

    go = "{{ range .Messages }}{{ .Role }}: {{ .Content }}\n{{ end }}"
    assert render_chat(go, [{"role": "user", "content": "Hi"}]) == "user: Hi\n"
    with pytest.raises(Cancelled):  # its lines are counted and checked like a Jinja template's
        render_chat(go, [{"role": "user", "content": "Hi"}], cancelled=lambda: True)
