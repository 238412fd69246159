"""Ollama's Go chat templates, translated into our sandboxed Jinja.

Ollama's library Modelfiles write TEMPLATE in Go's text/template: `{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}`,
`{{ range .Messages }}{{ .Role }}{{ .Content }}{{ end }}`, `{{ if .Tools }}`. `translate` turns the subset those
templates use into Jinja source, compiled in the same immutable sandbox as every other template, and `render_go`
renders it with Ollama's data: .System, .Messages (.Role, .Content, .ToolCalls, .ToolName ...), .Tools, .Prompt,
.Response. A construct outside the subset (`define`, `template`, `with`, `printf`, ...) is an InvalidInput that names
it: a template we cannot translate faithfully is refused, never rendered wrong.

The subset: output actions of fields (`.A.B`), variables (`$`, `$x`, `$.A`), literals and calls of eq ne lt le gt ge
and or not len index slice json printf currentDate yesterdayDate (also through `|`); `if` / `else if` / `else` /
`end`; `range` over a list or map, with `$i, $x :=`, `else`, `break` and `continue`; `$x := ...` and `$x = ...`;
comments; `{{-` and `-}}` trimming."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError

from ..errors import InvalidInput
from .sandbox import RenderBudget, new_environment, render_bounded

_ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.S)
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<pipe>\|)
  | (?P<comma>,)
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<variable>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+)
  | (?P<dot>\.)
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
""",
    re.X | re.S,
)
_BINARY = {"ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_CONSTANTS = {"true": "true", "false": "false", "nil": "none"}
_UNSUPPORTED_KEYWORDS = {"with", "define", "template", "block"}
_CUT = "\x00localllm-response\x00"  # where the last turn's {{ .Response }} stands: the prompt ends there
_HINT = (
    "localllm translates Ollama's usual subset: {{ .System }}, {{ .Prompt }}, {{ .Response }}, "
    "{{ range .Messages }}, {{ if }}/{{ else }}, .Role, .Content, .Tools, eq/and/or/not/len/json; or write "
    "TEMPLATE as a Jinja chat template"
)

GO_TEMPLATE = re.compile(r"\{\{-?\s*(?:\.|\$|if\s|range\s|end\s*-?\}\}|else\s*-?\}\}|/\*)")


def is_go_template(source: str) -> bool:
    """Whether `source` is written in Go's template syntax (Ollama's TEMPLATE) rather than Jinja."""
    return bool(GO_TEMPLATE.search(source))


class _Refused(Exception):
    def __init__(self, construct: str):
        super().__init__(construct)
        self.construct = construct


@dataclass
class _Scope:
    kind: str  # "if" or "range"
    dot: str  # the Jinja name of `.` inside the block


@dataclass
class _Translator:
    source: str
    out: list[str] = field(default_factory=list)
    scopes: list[_Scope] = field(default_factory=list)
    loops: int = 0

    @property
    def dot(self) -> str:
        return self.scopes[-1].dot if self.scopes else ""

    def run(self) -> str:
        # Go variables live in one namespace object: Jinja cannot otherwise assign, inside a loop, a variable
        # declared before it ($system = ... in Ollama's alpaca-style templates).
        self.out.append("{% set _v = namespace() %}")
        texts, actions = _split(self.source)
        for i, text in enumerate(texts):
            self._text(text)
            if i < len(actions):
                line = self.source.count("\n", 0, actions[i][1]) + 1
                try:
                    self._action(actions[i][0])
                except _Refused as exc:
                    raise InvalidInput(
                        f"the Go template uses {exc.construct} (line {line}), which localllm cannot translate",
                        hint=_HINT,
                    ) from None
        if self.scopes:
            raise InvalidInput(f"the Go template leaves a {{{{ {self.scopes[-1].kind} }}}} without its {{{{ end }}}}")
        return "".join(self.out)

    def _text(self, text: str) -> None:
        if not text:
            return
        if any(mark in text for mark in ("{{", "{%", "{#", "}}", "%}", "#}")):
            self.out.append("{{ " + json.dumps(text) + " }}")  # text that Jinja would read as its own syntax
        else:
            self.out.append(text)

    def _action(self, body: str) -> None:
        stripped = body.strip()
        if stripped.startswith("/*"):
            return  # a comment
        tokens = _tokenize(stripped)
        if not tokens:
            raise _Refused("an empty action {{ }}")
        head = tokens[0]
        if head == ("word", "if"):
            self.out.append("{% if " + self._pipeline(tokens[1:]) + " %}")
            self.scopes.append(_Scope("if", self.dot))
        elif head == ("word", "else"):
            self._else(tokens[1:])
        elif head == ("word", "end"):
            if not self.scopes:
                raise _Refused("an {{ end }} without an open {{ if }} or {{ range }}")
            scope = self.scopes.pop()
            self.out.append("{% endif %}" if scope.kind == "if" else "{% endfor %}")
        elif head == ("word", "range"):
            self._range(tokens[1:])
        elif head[0] == "word" and head[1] in ("break", "continue") and len(tokens) == 1:
            if not any(scope.kind == "range" for scope in self.scopes):
                raise _Refused(f"{{{{ {head[1]} }}}} outside a {{{{ range }}}}")
            self.out.append("{% " + head[1] + " %}")
        elif head[0] == "word" and head[1] in _UNSUPPORTED_KEYWORDS:
            raise _Refused(f"{{{{ {head[1]} }}}}")
        elif head[0] == "variable" and len(tokens) > 1 and tokens[1][0] in ("declare", "assign"):
            self.out.append("{% set " + _variable_name(head[1]) + " = " + self._pipeline(tokens[2:]) + " %}")
        else:
            expression = self._pipeline(tokens)
            self.out.append("{{ " + expression + " }}")
            if tokens == [("field", ".Response")] and not self.scopes:
                self.out.append("{{ _cut }}")

    def _else(self, tokens: list[tuple[str, str]]) -> None:
        if not self.scopes:
            raise _Refused("an {{ else }} without an open {{ if }} or {{ range }}")
        if not tokens:
            self.out.append("{% else %}")
        elif tokens[0] == ("word", "if") and self.scopes[-1].kind == "if":
            self.out.append("{% elif " + self._pipeline(tokens[1:]) + " %}")
        else:
            raise _Refused("{{ else " + " ".join(t[1] for t in tokens) + " }}")

    def _range(self, tokens: list[tuple[str, str]]) -> None:
        names: list[str] = []
        if any(kind == "declare" for kind, _ in tokens):
            while tokens and tokens[0][0] in ("variable", "comma"):
                if tokens[0][0] == "variable":
                    names.append(_variable_name(tokens[0][1]))
                tokens = tokens[1:]
            if not tokens or tokens[0][0] != "declare" or not 1 <= len(names) <= 2:
                raise _Refused("this form of {{ range }}")
            tokens = tokens[1:]
        self.loops += 1
        key, dot = f"_k{self.loops}", f"_d{self.loops}"
        sets = "".join(
            "{% set " + name + " = " + value + " %}"
            for name, value in zip(names, [key, dot] if len(names) == 2 else [dot])
        )
        self.out.append("{% for " + key + ", " + dot + " in _pairs(" + self._pipeline(tokens) + ") %}" + sets)
        self.scopes.append(_Scope("range", dot))

    # ----------------------------------------------------------------------------------------------- expressions

    def _pipeline(self, tokens: list[tuple[str, str]]) -> str:
        if not tokens:
            raise _Refused("an action with nothing to evaluate")
        commands = _split_top(tokens, "pipe")
        result = self._command(commands[0], None)
        for command in commands[1:]:
            result = self._command(command, result)
        return result

    def _command(self, tokens: list[tuple[str, str]], piped: str | None) -> str:
        operands = _operands(tokens)
        first = operands[0]
        if len(first) == 1 and first[0][0] == "word" and first[0][1] not in _CONSTANTS:
            args = [self._operand(o) for o in operands[1:]] + ([piped] if piped is not None else [])
            return _call(first[0][1], args)
        if len(operands) > 1 or piped is not None:
            raise _Refused("a call of something that is not a function")
        return self._operand(first)

    def _operand(self, tokens: list[tuple[str, str]]) -> str:
        if len(tokens) > 1:  # a parenthesised pipeline
            return "(" + self._pipeline(tokens[1:-1]) + ")"
        kind, text = tokens[0]
        if kind == "field":
            return _fields(self.dot, text)
        if kind == "dot":
            return self.dot or "_root"
        if kind == "variable":
            return _variable(text)
        if kind == "string":
            return json.dumps(json.loads(text))
        if kind == "raw":
            return json.dumps(text[1:-1])
        if kind == "number":
            return text
        if kind == "word" and text in _CONSTANTS:
            return _CONSTANTS[text]
        if kind == "word":
            return _call(text, [])
        raise _Refused(f"{text!r}")


def _split(source: str) -> tuple[list[str], list[tuple[str, int]]]:
    """The template's text pieces and its actions (with their offsets), `{{-` / `-}}` trimming applied."""
    texts: list[str] = []
    actions: list[tuple[str, int]] = []
    position, trim_next = 0, False
    for match in _ACTION.finditer(source):
        text = source[position : match.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if match.group(1):
            text = text.rstrip(" \t\r\n")
        texts.append(text)
        actions.append((match.group(2), match.start()))
        trim_next = bool(match.group(3))
        position = match.end()
    tail = source[position:]
    texts.append(tail.lstrip(" \t\r\n") if trim_next else tail)
    return texts, actions


def _tokenize(body: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(body):
        match = _TOKEN.match(body, position)
        if match is None:
            raise _Refused(f"{body[position : position + 12]!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


def _split_top(tokens: list[tuple[str, str]], kind: str) -> list[list[tuple[str, str]]]:
    """Split at `kind` tokens outside parentheses."""
    parts: list[list[tuple[str, str]]] = [[]]
    depth = 0
    for token in tokens:
        depth += token[0] == "open"
        depth -= token[0] == "close"
        if token[0] == kind and depth == 0:
            parts.append([])
        else:
            parts[-1].append(token)
    if any(not part for part in parts):
        raise _Refused(f"an empty part around {kind!r}")
    return parts


def _operands(tokens: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """A command's operands: single tokens, or a parenthesised group (kept with its parentheses)."""
    operands, i = [], 0
    while i < len(tokens):
        if tokens[i][0] == "open":
            depth, j = 0, i
            while j < len(tokens):
                depth += tokens[j][0] == "open"
                depth -= tokens[j][0] == "close"
                if depth == 0:
                    break
                j += 1
            if depth:
                raise _Refused("an unclosed parenthesis")
            operands.append(tokens[i : j + 1])
            i = j + 1
        elif tokens[i][0] in ("close", "comma", "declare", "assign"):
            raise _Refused(f"{tokens[i][1]!r} here")
        else:
            operands.append([tokens[i]])
            i += 1
    return operands


def _fields(base: str, chain: str) -> str:
    names = chain.strip(".").split(".")
    return ".".join(([base] if base else []) + names)


def _variable_name(text: str) -> str:
    if text == "$" or "." in text:
        raise _Refused(f"assigning to {text}")
    return "_v.v_" + text[1:]


def _variable(text: str) -> str:
    head, _, rest = text.partition(".")
    base = "_root" if head == "$" else "_v.v_" + head[1:]
    if head == "$" and rest:
        return rest  # $.System: a field of the root, which Jinja sees as a name
    return base + ("." + rest if rest else "")


def _call(name: str, args: list[str]) -> str:
    def need(n: int) -> None:
        if len(args) < n:
            raise _Refused(f"{name} with {len(args)} arguments")

    if name == "eq":
        need(2)
        return "(" + " or ".join(f"{args[0]} == {other}" for other in args[1:]) + ")"
    if name in _BINARY:
        need(2)
        return f"({args[0]} {_BINARY[name]} {args[1]})"
    if name in ("and", "or"):
        need(1)
        return f"_{name}(" + ", ".join(args) + ")"
    if name == "not":
        need(1)
        return f"(not {args[0]})"
    if name == "len":
        need(1)
        return f"({args[0]} | length)"
    if name == "index":
        need(2)
        return args[0] + "".join(f"[{a}]" for a in args[1:])
    if name == "slice":
        need(1)
        return f"{args[0]}[{args[1] if len(args) > 1 else ''}:{args[2] if len(args) > 2 else ''}]"
    if name == "json":
        need(1)
        return f"_json({args[0]})"
    if name in ("currentDate", "yesterdayDate"):
        return f"_{name}()"
    if name == "printf":
        need(1)
        return "_printf(" + ", ".join(args) + ")"
    raise _Refused(f"the function {name!r}")


# ---------------------------------------------------------------------------------------------------------- data


class GoMap(dict):
    """A map as Go templates see it: `.Function.Name` finds the key `function` / `name` too (Ollama's JSON names),
    and printing it writes JSON, as Ollama's tool types do."""

    def __getitem__(self, key: Any) -> Any:
        if not dict.__contains__(self, key) and isinstance(key, str) and key[:1].isupper():
            key = key[0].lower() + key[1:]
        return dict.__getitem__(self, key)

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


class GoList(list):
    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def go_value(value: Any) -> Any:
    if isinstance(value, dict):
        return GoMap({k: go_value(v) for k, v in value.items()})
    if isinstance(value, list):
        return GoList(go_value(v) for v in value)
    return value


def _pairs(value: Any) -> list[tuple[Any, Any]]:
    """What `range` walks: (index, item) of a list, (key, value) of a map in key order (as Go sorts them)."""
    if not value:
        return []
    if isinstance(value, dict):
        return sorted(value.items())
    return list(enumerate(value))


def _and(*values: Any) -> Any:
    for value in values:
        if not value:
            return value
    return values[-1]


def _or(*values: Any) -> Any:
    for value in values:
        if value:
            return value
    return values[-1]


def _printf(fmt: str, *args: Any) -> str:
    """Go's printf for the verbs chat templates use (%s, %d, %v, %q, %%)."""
    out, arg, i = [], 0, 0
    while i < len(fmt):
        if fmt[i] == "%" and i + 1 < len(fmt):
            verb = fmt[i + 1]
            if verb == "%":
                out.append("%")
            elif verb in "sdvq" and arg < len(args):
                value = args[arg]
                arg += 1
                out.append(json.dumps(str(value)) if verb == "q" else str(value))
            else:
                raise TemplateError(f"printf verb %{verb} is not supported")
            i += 2
        else:
            out.append(fmt[i])
            i += 1
    return "".join(out)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def collate(messages: Sequence[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate: every system message's text joined, and consecutive messages of one role (tools apart)
    merged into one."""
    system = "\n\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    merged: list[dict[str, Any]] = []
    for message in messages:
        if merged and merged[-1]["role"] == message.get("role") and message.get("role") != "tool":
            merged[-1] = {
                **merged[-1],
                "content": (merged[-1].get("content") or "") + "\n\n" + (message.get("content") or ""),
            }
        else:
            merged.append(dict(message))
    return system, merged


def _message(message: dict[str, Any]) -> GoMap:
    calls = [
        {
            "ID": c.get("id") or "",
            "Function": {"Index": i, "Name": c["function"]["name"], "Arguments": c["function"].get("arguments") or {}},
        }
        for i, c in enumerate(message.get("tool_calls") or [])
    ]
    return go_value(
        {
            "Role": message.get("role", ""),
            "Content": message.get("content") or "",
            "Thinking": message.get("thinking") or "",
            "ToolCalls": calls,
            "ToolName": message.get("tool_name") or "",
            "ToolCallID": message.get("tool_call_id") or "",
        }
    )


# ---------------------------------------------------------------------------------------------------------- compile


@lru_cache(maxsize=32)
def compile_go(source: str):
    """The Jinja template for a Go template; InvalidInput naming what cannot be translated."""
    jinja = _Translator(source).run()
    env = new_environment(keep_trailing_newline=True, autoescape=False, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(
        _pairs=_pairs,
        _and=_and,
        _or=_or,
        _json=_json,
        _printf=_printf,
        _currentDate=lambda: date.today().isoformat(),
        _yesterdayDate=lambda: (date.today() - timedelta(days=1)).isoformat(),
    )
    try:
        return env.from_string(jinja)
    except TemplateError as exc:
        raise InvalidInput(f"the Go template does not translate to a valid template: {exc}", hint=_HINT) from None


def render_go(
    source: str, messages: Sequence[dict[str, Any]], *, tools: list | None = None, budget: RenderBudget
) -> str:
    """Render as Ollama does: a template that reads .Messages gets the whole conversation at once; an older one
    (.System/.Prompt/.Response) is run once per turn, and the last turn stops at its {{ .Response }}. Every turn is
    charged to the one `budget`."""
    template = compile_go(source)
    system, merged = collate(messages)
    if ".Messages" in source:
        data = {
            "System": system,
            "Messages": GoList(_message(m) for m in merged),
            "Tools": go_value(list(tools)) if tools else GoList(),
            "Prompt": "",
            "Response": "",
            "_cut": "",
        }
        return render_bounded(template, {"_root": GoMap(data), **data}, budget)
    return _render_turns(template, merged, budget)


def _render_turns(template: Any, messages: list[dict[str, Any]], budget: RenderBudget) -> str:
    parts: list[str] = []
    turn = {"System": "", "Prompt": "", "Response": ""}

    def run(last: bool) -> None:
        data = {**turn, "_cut": _CUT if last else ""}
        parts.append(render_bounded(template, {"_root": GoMap(data), **data}, budget))
        turn.update(System="", Prompt="", Response="")

    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "system":
            if turn["Prompt"] or turn["Response"]:
                run(False)
            turn["System"] = content
        elif role == "user":
            if turn["Response"]:
                run(False)
            turn["Prompt"] = content
        elif role == "assistant":
            turn["Response"] = content
    run(True)
    return "".join(parts).split(_CUT, 1)[0]
