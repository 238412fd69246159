"""How a template family writes tool calls, and the lazy grammar that holds a call once the model begins one.

With `tool_choice` auto the answer is free text until a call begins: the template's opener (Hermes/Qwen
`<tool_call>`, Mistral `[TOOL_CALLS]`, Llama 3 `<|python_tag|>`) anywhere, or a JSON object naming an offered tool
at the answer's start (bare, in an array, or fenced), which small models write whatever their template says. From there
llama.cpp's lazy grammar allows only well-formed calls to the offered tools with arguments that fit their schemas.

A trigger pattern is anchored at both ends: llama.cpp replays the text from the match into the grammar, and a
replayed character the grammar rejects aborts the process. Ending the match where the answer so far ends means the
replay is exactly what the pattern matched, and every such text is a prefix the grammar accepts (a test checks it).
An answer whose tokens run past a trigger's end is left free, and parsed as before."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..api import GrammarTriggers, Tool
from .schema_grammar import schema_grammar
from .structured import tool_call_schema


@dataclass(frozen=True)
class CallFormat:
    """One family's call syntax: `opener` starts its calls (None: JSON only); `closer` ends each tagged call;
    `listed` calls follow the opener as one JSON array; `arguments_key` names the arguments' field."""

    name: str
    opener: str | None = None
    closer: str | None = None
    listed: bool = False
    arguments_key: str = "arguments"


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", listed=True)
LLAMA3 = CallFormat("llama3", "<|python_tag|>", arguments_key="parameters")
JSON_ONLY = CallFormat("json")


def call_format(template: str | None) -> CallFormat:
    """The family a chat template writes its calls in (JSON only when it names no opener)."""
    text = template or ""
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text and "[ARGS]" not in text:  # v11+ writes name[ARGS]{...}: not held, parsed as text
        return MISTRAL
    if "<|python_tag|>" in text or "ipython" in text:
        return LLAMA3
    return JSON_ONLY


@dataclass(frozen=True)
class LazyGrammar:
    """A grammar that waits for one of `triggers` before it constrains the answer."""

    grammar: str
    triggers: GrammarTriggers


# Whitespace the grammar allows between a call's tokens; the triggers allow the same, so they never match more.
_WS_COUNT = 24
_WS = f"[ \\t\\r\\n]{{0,{_WS_COUNT}}}"
_WS_RE = rf"[ \t\r\n]{{0,{_WS_COUNT}}}"
_NEXT_IN_ARRAY = 'space "," space tool-call'


def _call_head(names: list[str]) -> str:
    """A JSON call's head naming one of `names`, up to the next key's opening quote. A JSON object that names
    another tool stays free: the parser leaves it text, so a question no offered tool fits is not forced into one."""
    named = "|".join(re.escape(name) for name in names)
    return r"\{" + _WS_RE + r'"name"' + _WS_RE + ":" + _WS_RE + f'"(?:{named})"' + _WS_RE + "(?:," + _WS_RE + '"?)?'


def _patterns(names: list[str]) -> tuple[str, ...]:
    head = _call_head(names)
    return (
        r"^\s*(" + head + ")$",  # a JSON object naming an offered tool at the answer's start
        r"^\s*(\[" + _WS_RE + head + ")$",  # an array of them
        r"^\s*(```(?:json)?" + _WS_RE + r"(?:\[" + _WS_RE + ")?" + head + ")$",  # fenced
    )


def lazy_call_grammar(tools: list[Tool], fmt: CallFormat, *, parallel: bool = True) -> LazyGrammar:
    """Constrained once begun: after a trigger, only well-formed calls to `tools` with arguments that fit their
    schemas, in the form the trigger began; `parallel` allows more than one call."""
    call = schema_grammar(tool_call_schema(tools, arguments_key=fmt.arguments_key))
    call = re.sub(r"^root ::=", "tool-call ::=", call, flags=re.M)
    call = re.sub(r"^space ::=.*$", lambda _: f"space ::= {_WS}", call, flags=re.M)
    rules = [
        f"calls ::= tool-call {_again('space tool-call', parallel)} | "
        f'"[" space tool-call {_again(_NEXT_IN_ARRAY, parallel)} space "]"',
        "bare ::= calls",
        f"fenced ::= fence {_again('space fence', parallel)}",
        'fence ::= "```" "json"? space calls space "```"',
    ]
    forms = ["bare", "fenced"]
    if fmt.opener is not None:
        forms.append("opened")
        rules.append(f"opened ::= {_opened(fmt, parallel)}")
    words = (fmt.opener,) if fmt.opener else ()
    grammar = "\n".join([f"root ::= {' | '.join(forms)}", *rules, call])
    return LazyGrammar(grammar, GrammarTriggers(_patterns([t.function.name for t in tools]), words))


def _opened(fmt: CallFormat, parallel: bool) -> str:
    opener = _literal(fmt.opener or "")
    if fmt.closer is not None:
        tagged = f"{opener} space tool-call space {_literal(fmt.closer)}"
        return f"{tagged} {_again('space ' + tagged, parallel)}"
    if fmt.listed:
        return f'{opener} space "[" space tool-call {_again(_NEXT_IN_ARRAY, parallel)} space "]"'
    return f"{opener} space tool-call"


def _again(item: str, parallel: bool) -> str:
    """More calls after the first, where parallel calls are allowed."""
    return f"({item})*" if parallel else ""


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def word_pattern(word: str) -> str:
    """The trigger pattern for an opener the tokenizer spells in pieces: it ends where the answer so far ends."""
    return "(" + re.escape(word) + _WS_RE + ")$"
