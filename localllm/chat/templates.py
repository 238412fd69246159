"""Chat templates: render a conversation into the prompt text a model was trained on.

The template is the model's own Jinja chat template from GGUF metadata (or a Modelfile TEMPLATE, which overrides it),
rendered in a bounded jinja2 sandbox (sandbox.py): a template is data from a downloaded file or a request, so
it must not reach Python internals, mutate what it is given, or run without end. A model without any template (a base
model) gets a plain transcript. A TEMPLATE in Ollama's Go syntax is translated into the same sandbox
(go_templates.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError

from .. import api
from ..errors import InvalidInput
from .go_templates import compile_go, is_go_template, render_go
from .sandbox import new_budget, new_environment, render_bounded

# For models that ship no chat template (base models): a transcript the model can continue.
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content ~ '\\n\\n' }}"
    "{% elif m.role == 'user' %}{{ 'User: ' ~ m.content ~ '\\n' }}"
    "{% elif m.role == 'tool' %}{{ 'Tool result: ' ~ m.content ~ '\\n' }}"
    "{% else %}{{ 'Assistant: ' ~ m.content ~ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


# A base model continues the transcript past its own turn, writing the user's next line and answering it in turn;
# these end the answer where the next turn would begin, and the cap ends one that never reaches a turn marker
# (as a chat answer, not a document that fills the context).
TRANSCRIPT_STOPS = ("\nUser:", "\nAssistant:", "\nTool result:")
TRANSCRIPT_NUM_PREDICT = 512


def transcript_sampling(sampling: api.SamplingOptions) -> api.SamplingOptions:
    """The sampling options for a model chatted through PLAIN_TEMPLATE: its turn markers added to the stop strings,
    and num_predict capped when the user left it unlimited (-1; -2, "until the context is full", is kept)."""
    stops = list(sampling.stop) + [stop for stop in TRANSCRIPT_STOPS if stop not in sampling.stop]
    num_predict = TRANSCRIPT_NUM_PREDICT if sampling.num_predict == -1 else sampling.num_predict
    return sampling.model_copy(update={"stop": stops, "num_predict": num_predict})


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    if indent is not None and not 0 <= indent <= 16:  # every line of the output pays it
        raise InvalidInput(f"tojson indent {indent} is outside 0..16")
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(source: str):
    env = new_environment(filters={"tojson": _tojson}, trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise InvalidInput(f"the chat template does not parse: {exc}") from None


def validate_template(source: str) -> None:
    """Raise InvalidInput when `source` is not a usable chat template: Jinja that does not parse, or a Go template
    outside the subset we translate (the message names the construct)."""
    if is_go_template(source):
        compile_go(source)
    else:
        _compile(source)


def render_chat(
    template: str | None,
    messages: Sequence[dict[str, Any]],
    *,
    tools: list | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    extra: dict[str, Any] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> str:
    """Render `messages` (dicts with role/content/...) with `template` (None: the plain transcript).

    Raises InvalidInput when the template fails or goes past a bound (TemplateTooCostly), Cancelled when
    `cancelled()` turns true while it renders (the client left)."""
    budget = new_budget(len(messages) + len(tools or ()), cancelled)
    if template and is_go_template(template):
        return render_go(template, messages, tools=tools, budget=budget)
    compiled = _compile(template or PLAIN_TEMPLATE)
    context = {
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        **(extra or {}),
    }
    if tools:
        context["tools"] = tools
    return render_bounded(compiled, context, budget)
