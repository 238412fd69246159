"""The sandbox every chat template renders in: jinja2's ImmutableSandboxedEnvironment, bounded.

The sandbox stops attribute tricks, not work: `{{ 'a' * 400000000 }}` or nested loops would take gigabytes or CPU
minutes. So every render runs under a RenderBudget: a count of template lines executed (a trace function that sees
only the template's own frames), a wall-clock deadline, the request's cancellation, a ceiling on every string or list
an operator, call or filter makes, and on the output. Operations that can make a huge value in one native step
(repetition, powers, format widths, replace, join, expandtabs, indent) are sized before they run. Jinja chat templates
(templates.py) and Ollama's Go templates, translated to Jinja (go_templates.py), both render here."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Environment, TemplateError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import Cancelled, InvalidInput, LocalLLMError

# Bounds on one render. Real chat templates run a few dozen lines per message and print about what they are given.
MAX_OUTPUT_CHARS = 16 * 2**20  # more prompt text than any model's context holds
MAX_MADE_CHARS = 8 * MAX_OUTPUT_CHARS  # everything operators, calls and filters build, added up
BASE_STEPS = 2_000_000  # template lines executed, plus STEPS_PER_ITEM for every message and tool
STEPS_PER_ITEM = 500
MAX_SECONDS = 5.0
MAX_NUMBER_ARG = 1_000_000  # a width, count or length passed to a call, filter or format
MAX_INT_BITS = 4096


# ---------------------------------------------------------------------------------------------------------- bounds


class TemplateTooCostly(InvalidInput):
    """A render that went past one of the RenderBudget's bounds."""


@dataclass
class RenderBudget:
    """What one render may spend. Charged from the trace function and the sandbox's hooks on the render's thread."""

    max_steps: int
    deadline: float
    cancelled: Callable[[], bool] | None = None
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
    return TemplateTooCostly(
        f"the chat template was stopped: it {what}",
        hint="fix the template: the request's, the Modelfile's TEMPLATE or the model's own",
    )


_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("localllm_render_budget", default=None)


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
    return (*values[:index], list(values[index]), *values[index + 1 :])


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


def new_environment(*, filters: dict[str, Callable] | None = None, **options: Any) -> BoundedSandbox:
    """A bounded sandbox: `filters` added, every filter's result charged, lipsum gone (paragraphs of filler by the
    million: no chat template needs it)."""
    env = BoundedSandbox(**options)
    env.filters.update(filters or {})
    del env.globals["lipsum"]
    env.filters.update({name: _bounded_filter(name, run) for name, run in env.filters.items()})
    return env


def new_budget(items: int, cancelled: Callable[[], bool] | None = None) -> RenderBudget:
    """The budget of one render over `items` messages and tools."""
    return RenderBudget(
        max_steps=BASE_STEPS + STEPS_PER_ITEM * items, deadline=time.monotonic() + MAX_SECONDS, cancelled=cancelled
    )


def render_bounded(compiled: Any, context: dict[str, Any], budget: RenderBudget) -> str:
    """Render a template compiled in a new_environment() with `budget` charged; errors become InvalidInput."""
    with template_errors():
        return _render_bounded(compiled, context, budget)


@contextlib.contextmanager
def template_errors() -> Iterator[None]:
    """A failing template is the input's fault: InvalidInput (TemplateTooCostly past a bound), Cancelled when the
    client left."""
    try:
        yield
    except LocalLLMError:
        raise
    except SecurityError as exc:
        raise InvalidInput(f"the chat template tried an unsafe operation and was stopped: {exc}") from None
    except (
        TemplateError,
        ArithmeticError,
        LookupError,
        TypeError,
        ValueError,
        AttributeError,
        RecursionError,
        MemoryError,
    ) as exc:  # OverflowError (the sandbox's "range too big") is an ArithmeticError
        raise InvalidInput(f"the chat template failed: {exc}") from None
