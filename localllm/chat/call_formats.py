"""How a template family writes tool calls, and the lazy grammar that holds a call once the model begins one.

With `tool_choice` auto the answer is free text until a call begins: the template's opener (Hermes/Qwen
`<tool_call>`, Mistral `[TOOL_CALLS]`, Llama 3 `<|python_tag|>`, FunctionGemma `<start_function_call>`, Gemma 4
`<|tool_call>`) anywhere, or a JSON object naming an offered tool at the answer's start (bare, in an array, or fenced
as json, tool_code or tool_call), which small models write whatever their template says. From there llama.cpp's lazy
grammar allows only well-formed calls to the offered tools with arguments that fit their schemas. Two families write
no JSON head: Mistral v11+ (`[TOOL_CALLS]name[ARGS]{arguments}`, its arguments held to the tool's schema) and
Gemma's `call:name{key:value}` (the tool's name and keys held; its values, in Gemma's own quoting, only well-formed,
as llama.cpp holds them).

A trigger pattern is anchored at both ends: llama.cpp replays the text from the match into the grammar, and a
replayed character the grammar rejects aborts the process. Ending the match where the answer so far ends means the
replay is exactly what the pattern matched, and every such text is a prefix the grammar accepts (a test checks it).
An answer whose tokens run past a trigger's end is left free, and parsed as before."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..api import GrammarTriggers, Tool
from .schema_grammar import schema_grammar
from .structured import grammar_parameters, tool_call_schema


@dataclass(frozen=True)
class CallFormat:
    """One family's call syntax: `opener` starts its calls (None: JSON only); `closer` ends each tagged call;
    `listed` calls follow the opener as one JSON array; `arguments_key` names the arguments' field. `args_mark`:
    the opener is followed by the tool's name, this mark and the arguments' JSON (Mistral v11+), with `call_id` a
    `[CALL_ID]` and nine letters or digits before the mark (Mistral Small 3.2). `quote`: the opener is followed by
    `call:name{key:value,...}`, strings between two `quote`s (Gemma)."""

    name: str
    opener: str | None = None
    closer: str | None = None
    listed: bool = False
    arguments_key: str = "arguments"
    args_mark: str | None = None
    call_id: bool = False
    quote: str | None = None


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", listed=True)
MISTRAL_ARGS = CallFormat("mistral-args", "[TOOL_CALLS]", args_mark="[ARGS]")
MISTRAL_CALL_ID = CallFormat("mistral-call-id", "[TOOL_CALLS]", args_mark="[ARGS]", call_id=True)
LLAMA3 = CallFormat("llama3", "<|python_tag|>", arguments_key="parameters")
FUNCTION_GEMMA = CallFormat("functiongemma", "<start_function_call>", "<end_function_call>", quote="<escape>")
GEMMA4 = CallFormat("gemma4", "<|tool_call>", "<tool_call|>", quote='<|"|>')
JSON_ONLY = CallFormat("json")  # also Gemma 2 and 3, whose templates name no call syntax: they write fenced JSON


def call_format(template: str | None) -> CallFormat:
    """The family a chat template writes its calls in (JSON only when it names no opener)."""
    text = template or ""
    if "<start_function_call>" in text:
        return FUNCTION_GEMMA
    if "<|tool_call>" in text:
        return GEMMA4
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        if "[ARGS]" not in text:
            return MISTRAL
        return MISTRAL_CALL_ID if "[CALL_ID]" in text else MISTRAL_ARGS
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
_FENCE_LANGS = ("json", "tool_code", "tool_call")  # Gemma's fences, and JSON's


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
        r"^\s*(```(?:" + "|".join(_FENCE_LANGS) + ")?" + _WS_RE + r"(?:\[" + _WS_RE + ")?" + head + ")$",  # fenced
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
        f'fence ::= "```" ({" | ".join(map(_literal, _FENCE_LANGS))})? space calls space "```"',
    ]
    forms = ["bare", "fenced"]
    if fmt.args_mark is not None:
        forms.append("opened")
        rules += _marked_calls(tools, fmt, parallel, call)
    elif fmt.quote is not None:
        forms.append("opened")
        rules += _colon_calls(tools, fmt, parallel)
    elif fmt.opener is not None:
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


def _marked_calls(tools: list[Tool], fmt: CallFormat, parallel: bool, call: str) -> list[str]:
    """Mistral v11+: `[TOOL_CALLS]name[ARGS]{...}`, each call with its opener; each tool's arguments held by its own
    schema's rules, renamed apart from the other tools' and from the JSON call's."""
    taken = set(_RULE_DEF.findall(call))
    mark = _literal(fmt.args_mark or "")
    call_id = ' ("[CALL_ID]" [a-zA-Z0-9]{9})?' if fmt.call_id else ""
    heads, rules = [], []
    for i, tool in enumerate(tools):
        arguments = schema_grammar(grammar_parameters(tool.function.parameters or {"type": "object"}))
        prefix = _free_prefix(f"args{i}-", taken)
        rules += [line for line in _prefixed(arguments, prefix).splitlines() if not line.startswith("space ::=")]
        heads.append(f"{_literal(tool.function.name)}{call_id} {mark} {prefix}root")
    named = f"{_literal(fmt.opener or '')} space named-tool"
    return [
        f"opened ::= named-call {_again('space named-call', parallel)}",
        f"named-call ::= {named}",
        f"named-tool ::= {' | '.join(heads)}",
        *rules,
    ]


def _colon_calls(tools: list[Tool], fmt: CallFormat, parallel: bool) -> list[str]:
    """Gemma's `call:name{key:value,...}` between its opener and closer: an offered tool's name and, where its schema
    lists them, its keys; values are Gemma's (strings between `quote`s, numbers, booleans, lists, dicts), not held to
    the schema: llama.cpp holds them no further either."""
    heads, members = [], []
    for i, tool in enumerate(tools):
        keys = list((tool.function.parameters or {}).get("properties") or {})
        key = " | ".join(_literal(k) for k in keys) if keys else "gemma-key"
        heads.append(f'{_literal(tool.function.name)} "{{" space (gemma-kv{i} ("," space gemma-kv{i})*)? space "}}"')
        members.append(f'gemma-kv{i} ::= ({key}) ":" space gemma-value')
    quote = _literal(fmt.quote or "")
    return [
        f"opened ::= gemma-call {_again('space gemma-call', parallel)}",
        f'gemma-call ::= {_literal(fmt.opener or "")} space "call:" gemma-tool space {_literal(fmt.closer or "")}',
        f"gemma-tool ::= {' | '.join(heads)}",
        *members,
        'gemma-value ::= gemma-string | gemma-dict | gemma-list | gemma-number | "true" | "false" | "null"',
        f"gemma-string ::= {quote} {_until(fmt.quote or '')} {quote}",
        'gemma-dict ::= "{" space (gemma-kv ("," space gemma-kv)*)? space "}"',
        'gemma-kv ::= gemma-key ":" space gemma-value',
        r"gemma-key ::= [^:{}\[\],<> \t\r\n\x22]+",
        'gemma-list ::= "[" space (gemma-value ("," space gemma-value)*)? space "]"',
        'gemma-number ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
    ]


def _until(quote: str) -> str:
    """Text up to `quote`, none inside: any character but its first, or a proper prefix of it and a character that
    neither continues it nor starts it again (so a string cannot hold the quote's first character twice in a row)."""
    alternatives = [f"[^{_class_char(quote[0])}]"]
    for k in range(1, len(quote)):
        alternatives.append(f"{_literal(quote[:k])} [^{_class_char(quote[k])}{_class_char(quote[0])}]")
    return f"({' | '.join(alternatives)})*"


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch


# A GBNF rule's definition, and its tokens: string literals and character classes (never renamed), names, the rest.
_RULE_DEF = re.compile(r"^([A-Za-z0-9-]+) ::=", re.M)
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9-]+|.', re.S)


def _prefixed(grammar: str, prefix: str) -> str:
    """`grammar` with every rule it defines renamed `prefix` + name, but `space` (one rule for the whole grammar)."""
    defined = set(_RULE_DEF.findall(grammar)) - {"space"}
    return _GBNF_TOKEN.sub(lambda m: prefix + m.group(0) if m.group(0) in defined else m.group(0), grammar)


def _free_prefix(prefix: str, taken: set[str]) -> str:
    """`prefix`, lengthened until no rule in `taken` starts with it."""
    while any(name.startswith(prefix) for name in taken):
        prefix = "x" + prefix
    return prefix


def _again(item: str, parallel: bool) -> str:
    """More calls after the first, where parallel calls are allowed."""
    return f"({item})*" if parallel else ""


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def word_pattern(word: str) -> str:
    """The trigger pattern for an opener the tokenizer spells in pieces: it ends where the answer so far ends."""
    return "(" + re.escape(word) + _WS_RE + ")$"
