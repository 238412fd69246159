"""Chat templates: render a conversation into the prompt text a model was trained on.

The template is the model's own Jinja chat template from GGUF metadata (or a Modelfile TEMPLATE, which overrides it),
rendered in jinja2's ImmutableSandboxedEnvironment: a template is data from a downloaded file or a request, so it must
not reach Python internals or mutate what it is given. A model without any template (a base model) gets a plain
transcript.

The sandbox stops attribute tricks, not work: `{{ 'a' * 400000000 }}` or nested loops would take gigabytes or CPU
minutes. So every render runs under a RenderBudget: a count of template lines executed (a trace function that sees
only the template's own frames), a wall-clock deadline, the request's cancellation, a ceiling on every string or list
an operator, call or filter makes, and on the output. Operations that can make a huge value in one native step
(repetition, powers, format widths, replace, join, expandtabs, indent) are sized before they run."""

from __future__ import annotations

import contextvars
import functools
import json
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Optional, Sequence

from jinja2 import Environment, TemplateError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import Cancelled, InvalidInput, LocalLLMError

# Bounds on one render. Real chat templates run a few dozen lines per message and print about what they are given.
MAX_OUTPUT_CHARS = 16 * 2**20  # more prompt text than any model's context holds
MAX_MADE_CHARS = 8 * MAX_OUTPUT_CHARS  # everything operators, calls and filters build, added up
BASE_STEPS = 2_000_000  # template lines executed, plus STEPS_PER_ITEM for every message and tool
STEPS_PER_ITEM = 500
MAX_SECONDS = 5.0
MAX_NUMBER_ARG = 1_000_000  # a width, count or length passed to a call, filter or format
MAX_INT_BITS = 4096

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


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    if indent is not None and not 0 <= indent <= 16:  # every line of the output pays it
        raise InvalidInput(f"tojson indent {indent} is outside 0..16")
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


_GO_TEMPLATE = re.compile(r"{{-?\s*(\.[A-Z]|if \.|range \.)")


# ---------------------------------------------------------------------------------------------------------- bounds

class TemplateTooCostly(InvalidInput):
    """A render that went past one of the RenderBudget's bounds."""


@dataclass
class RenderBudget:
    """What one render may spend. Charged from the trace function and the sandbox's hooks on the render's thread."""

    max_steps: int
    deadline: float
    cancelled: Optional[Callable[[], bool]] = None
    steps: int = 0
    made: int = 0
    output: int = field(default=0)

    def step(self) -> None:
        """One template line, call, attribute or filter: the clock is read every time, since one step can be an
        expensive filter."""
        self.steps += 1
        if self.steps > self.max_steps:
            raise _too_costly(f"ran over {self.max_steps:,} steps (loops nested too deep?)")
        if time.monotonic() > self.deadline:
            raise _too_costly(f"ran over {MAX_SECONDS:g} seconds")
        if self.cancelled is not None and self.cancelled():
            raise Cancelled("the request was cancelled while its template rendered")

    def charge(self, value: Any) -> Any:
        """Count a value an operator, call or filter made; refuse one too large to keep."""
        if isinstance(value, (str, list, tuple, dict)):
            size = len(value)
            if size > MAX_OUTPUT_CHARS:
                raise _too_costly(f"made a value of {size:,} items (the limit is {MAX_OUTPUT_CHARS:,})")
            self.made += size
            if self.made > MAX_MADE_CHARS:
                raise _too_costly(f"built over {MAX_MADE_CHARS:,} characters in all")
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise _too_costly(f"made a number of {value.bit_length():,} bits")
        return value


def _too_costly(what: str) -> TemplateTooCostly:
    return TemplateTooCostly(f"the chat template was stopped: it {what}",
                             hint="fix the template: the request's, the Modelfile's TEMPLATE or the model's own")


_BUDGET: contextvars.ContextVar[Optional[RenderBudget]] = contextvars.ContextVar("localllm_render_budget",
                                                                                 default=None)


def _charge(value: Any) -> Any:
    """Count a step and the value it made, when a render is under way (compile-time constant folding is not)."""
    budget = _BUDGET.get()
    if budget is None:
        return value
    budget.step()
    return budget.charge(value)


def _refuse_size(size: int, what: str) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise _too_costly(f"asked for {what} of {size:,} characters (the limit is {MAX_OUTPUT_CHARS:,})")


def _check_numbers(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_NUMBER_ARG:
            raise _too_costly(f"passed the number {value} to a call (the limit is {MAX_NUMBER_ARG:,})")


_DIGITS = re.compile(r"\d+")


def _check_format(text: str) -> None:
    """A %-format or str.format string whose widths or precisions would pad to a huge string."""
    if any(len(run) > 7 or int(run) > MAX_NUMBER_ARG for run in _DIGITS.findall(text)):
        raise _too_costly("used a format width over the limit")


def _size_of_call(name: str, owner: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The size a string method or filter will make, for those that can multiply their input; 0 when bounded."""
    if name == "wordwrap" and isinstance(owner, str):
        width, wrap = (list(args) + [79, True, "\n"])[0], kwargs.get("wrapstring") or "\n"
        return len(owner) + (len(owner) // max(int(width), 1) + 1) * len(str(wrap))
    if not isinstance(owner, str) or not args:
        return 0
    first = args[0]
    if name == "replace" and len(args) > 1 and isinstance(first, str) and isinstance(args[1], str):
        hits = owner.count(first) if first else len(owner) + 1
        return len(owner) + hits * len(args[1])
    if name == "join" and isinstance(first, (list, tuple)):
        return sum(len(item) for item in first if isinstance(item, str)) + len(owner) * len(first)
    if name == "expandtabs" and isinstance(first, int):
        return len(owner) + owner.count("\t") * first
    if name == "indent" and isinstance(first, int):
        return len(owner) + (owner.count("\n") + 1) * first
    return 0


def _check_call(name: str, owner: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    _check_numbers(args, kwargs)
    if name in ("format", "format_map") and isinstance(owner, str):
        _check_format(owner)
    _refuse_size(_size_of_call(name, owner, args, kwargs), f"the result of {name}()")


def _listed(values: Sequence[Any], index: int) -> tuple[Any, ...]:
    """`values` with the iterable at `index` made a list, so that a join over a generator can be sized first (the
    sandbox's range and the request's size bound how long it is)."""
    if len(values) <= index or isinstance(values[index], (str, list, tuple)):
        return tuple(values)
    return (*values[:index], list(values[index]), *values[index + 1:])


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                _refuse_size(len(seq) * max(times, 0), "a repetition")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _too_costly("multiplied numbers past the limit")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right > 0 and right * left.bit_length() > MAX_INT_BITS:
            raise _too_costly(f"raised a number to the power {right}")
    elif operator == "%" and isinstance(left, str):
        _check_format(left)
        _check_numbers(right if isinstance(right, tuple) else (right,), {})


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every operator, call, attribute and filter result charged to the render's budget,
    and the operations that can make a huge value sized first."""

    intercepted_binops = frozenset({"*", "**", "%", "+", "//", "/"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _charge(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's names
        inner = getattr(__obj, "__wrapped__", __obj)  # str.format arrives wrapped by the sandbox
        name, owner = getattr(inner, "__name__", ""), getattr(inner, "__self__", None)
        if name == "join" and isinstance(owner, str):
            args = _listed(args, 0)
        _check_call(name, owner, args, kwargs)
        return _charge(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _charge(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _charge(super().getitem(obj, argument))


_PASSED = (Context, EvalContext, Environment)


def _bounded_filter(name: str, run: Callable) -> Callable:
    @functools.wraps(run)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        passed = 1 if args and isinstance(args[0], _PASSED) else 0  # pass_context / pass_environment filters
        values = _listed(args[passed:], 0) if name == "join" else args[passed:]
        if name == "join" and values:  # join(items, separator): sized as the separator's str.join
            _check_call("join", (list(values[1:]) or [kwargs.get("d", "")])[0], [values[0]], {})
        elif values:
            _check_call(name, values[0], values[1:], kwargs)
        if name == "format" and values and isinstance(values[0], str):
            _check_format(values[0])
        return _charge(run(*args[:passed], *values, **kwargs))

    return bounded


def _render_bounded(compiled: Any, context: dict[str, Any], budget: RenderBudget) -> str:
    """Render with `budget` charged: a trace function counts the template's own lines (jinja compiles a template to
    Python code named "<template>"; every other frame is left untraced), the output is summed as it streams."""

    def trace_line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            budget.step()
        return trace_line

    def trace_call(frame: Any, event: str, arg: Any) -> Any:
        return trace_line if frame.f_code.co_filename == "<template>" else None

    parts: list[str] = []
    token = _BUDGET.set(budget)
    previous = sys.gettrace()
    sys.settrace(trace_call)
    try:
        for part in compiled.generate(**context):
            budget.output += len(part)
            if budget.output > MAX_OUTPUT_CHARS:
                raise _too_costly(f"printed over {MAX_OUTPUT_CHARS:,} characters")
            parts.append(part)
    finally:
        sys.settrace(previous)
        _BUDGET.reset(token)
    return "".join(parts)


@lru_cache(maxsize=32)
def _compile(source: str):
    if _GO_TEMPLATE.search(source):
        # Ollama's TEMPLATE is a Go template ({{ .Prompt }}); ours is a Jinja chat template, as in GGUF metadata.
        raise InvalidInput("the template uses Go template syntax ({{ .Prompt }}, as Ollama's TEMPLATE does); "
                           "localllm templates are Jinja chat templates",
                           hint="write it with messages, e.g. {% for m in messages %}{{ m.content }}{% endfor %}, "
                                "or drop TEMPLATE to use the model's own")
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    del env.globals["lipsum"]  # paragraphs of filler by the million: no chat template needs it
    env.filters.update({name: _bounded_filter(name, run) for name, run in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise InvalidInput(f"the chat template does not parse: {exc}") from None


def validate_template(source: str) -> None:
    """Raise InvalidInput when `source` is not a usable chat template (Go syntax, or Jinja that does not parse)."""
    _compile(source)


def render_chat(template: Optional[str], messages: Sequence[dict[str, Any]], *, tools: Optional[list] = None,
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                extra: Optional[dict[str, Any]] = None, cancelled: Optional[Callable[[], bool]] = None) -> str:
    """Render `messages` (dicts with role/content/...) with `template` (None: the plain transcript).

    Raises InvalidInput when the template fails or goes past a bound (TemplateTooCostly), Cancelled when
    `cancelled()` turns true while it renders (the client left)."""
    compiled = _compile(template or PLAIN_TEMPLATE)
    context = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt,
               "bos_token": bos_token, "eos_token": eos_token, **(extra or {})}
    if tools:
        context["tools"] = tools
    budget = RenderBudget(max_steps=BASE_STEPS + STEPS_PER_ITEM * (len(messages) + len(tools or ())),
                          deadline=time.monotonic() + MAX_SECONDS, cancelled=cancelled)
    try:
        return _render_bounded(compiled, context, budget)
    except LocalLLMError:
        raise
    except SecurityError as exc:
        raise InvalidInput(f"the chat template tried an unsafe operation and was stopped: {exc}") from None
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError,
            MemoryError) as exc:  # OverflowError (the sandbox's "range too big") is an ArithmeticError
        raise InvalidInput(f"the chat template failed: {exc}") from None
