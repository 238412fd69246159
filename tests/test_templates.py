"""Chat templates render in jinja2's sandbox: real templates work, hostile ones fail safely."""

from __future__ import annotations

import pytest

from localllm.errors import InvalidInput
from localllm.templates import PLAIN_TEMPLATE, render_chat

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


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


@pytest.mark.parametrize("hostile", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages | length }}",
    "{{ messages[0].update({'content': 'changed'}) }}",
])
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
