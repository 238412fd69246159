"""Tool calls in a model's answer, parsed as it streams: one parser for every route, streamed or not.

Models write calls in a few shapes: their template's syntax (Qwen's and Hermes' `<tool_call>{json}</tool_call>`,
several in a row for a multi-call turn; Mistral's `[TOOL_CALLS][{json}]` or, v11+, `[TOOL_CALLS]name[ARGS]{json}`;
Gemma's `call:name{key:value}` between FunctionGemma's or Gemma 4's tokens), and the JSON small models emit instead:
a bare object or array of {"name", "arguments"} at the start of the answer (what a forced call's grammar produces too),
or the same inside a ```json (```tool_code, ```tool_call) fence. `ToolCallParser.feed` takes the answer's text as it
arrives and gives back the content that is surely text and the calls' pieces (`ToolCallDelta`: a call's id and name,
then fragments of its arguments' JSON, as OpenAI streams them; a Gemma call's whole, once its arguments end). Text that
may be the start of a call is held back until it is decided: a call naming an unknown tool, or JSON that is not a
call, goes out as text after all."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..api import Tool, ToolCall, ToolCallDelta, ToolCallFunction
from .thinking import held_back

TAG_OPEN = "<tool_call>"
TAG_CLOSE = "</tool_call>"
# Tags small models wrap a call in instead of their template's: a call inside is taken, and said to be repaired.
NEAR_TAGS = {"<function_call>": "</function_call>", "<tools>": "</tools>", "<json>": "</json>"}
TAGS = {TAG_OPEN: TAG_CLOSE, **NEAR_TAGS}
# Openers after which a call's JSON follows with no closer (Mistral's array, Llama 3's object), where a bare call may.
PREFIX_OPENERS = ("[TOOL_CALLS]", "<|python_tag|>")
MISTRAL_OPENER = "[TOOL_CALLS]"  # also anywhere: v11+ writes `[TOOL_CALLS]name[ARGS]{json}`, one opener per call
# Gemma's `call:name{key:value,...}`: FunctionGemma's and Gemma 4's opener -> (closer, the quote around strings).
COLON_CALLS = {"<start_function_call>": ("<end_function_call>", "<escape>"), "<|tool_call>": ("<tool_call|>", '<|"|>')}
FENCE = "```"
_MARKERS = (*TAGS, MISTRAL_OPENER, *COLON_CALLS, FENCE)
_FENCE_LANGS = ("", "json", "tool_call", "tool_code")
# The head of a call whose arguments can stream: `{"name": "...", "arguments": ` (or "parameters"), then a `{`.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)', re.S)
_FIRST_KEY = re.compile(r'\{\s*"((?:[^"\\]|\\.)*)"', re.S)
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)
_FENCE_HEAD = re.compile(r"```([A-Za-z_]*)(\s*)")
_MAX_FENCE_LANG = 16
# Mistral v11+'s head after its opener: the name, Mistral Small 3.2's call id, the mark, then the arguments' `{`.
_MARKED_HEAD = re.compile(r"([\w.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]\s*")
_MARKED_SO_FAR = re.compile(r"[\w.\-\[\]]*")  # what such a head may be while it arrives
_COLON_HEAD = re.compile(r"call:([\w.\-]+)\{")
_COLON_SO_FAR = re.compile(r"(?:c(?:a(?:l(?:l(?::[\w.\-]*)?)?)?)?)?")
_MAX_HEAD = 256  # a name longer than this is no tool's


@dataclass
class Parsed:
    """What one piece of the answer decided: text to show and pieces of calls."""

    content: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.deltas += other.deltas
        return self


class _Strings:
    """Whether JSON text fed a character at a time is inside a string (escapes followed)."""

    def __init__(self) -> None:
        self.inside = False
        self._escaped = False

    def step(self, ch: str) -> bool:
        """Take `ch`; True when it is part of a string (its quotes included)."""
        if self.inside:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self.inside = False
            return True
        self.inside = ch == '"'
        return self.inside


class _JsonEnd:
    """Finds where one JSON value ends in text fed piece by piece: counts brackets outside strings."""

    def __init__(self) -> None:
        self.depth = 0
        self._strings = _Strings()

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None while it goes on."""
        for i, ch in enumerate(text):
            if self._strings.step(ch):
                continue
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class _ArgsCleaner:
    """Streams a call's arguments with trailing commas dropped (`{"a": 1,}`): a comma outside strings is held back
    until what follows it shows whether it ends an object or array. `dropped` says whether one was."""

    def __init__(self) -> None:
        self._strings = _Strings()
        self._held = ""  # a comma and the whitespace after it
        self.dropped = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if self._held:
                if ch in " \t\r\n":
                    self._held += ch
                    continue
                if ch in "}]":
                    self._held, self.dropped = "", True
                else:
                    out.append(self._held)
                    self._held = ""
            if not self._strings.step(ch) and ch == ",":
                self._held = ch
                continue
            out.append(ch)
        return "".join(out)


@dataclass
class _Call:
    """One call object being read: its raw text, and once its head is known, its id, name and streamed arguments."""

    index: int
    text: str = ""
    id: str | None = None
    name: str | None = None
    args_start: int = -1
    args_end: int = -1
    sent: int = 0  # characters of the arguments already read into `cleaner`
    marked: bool = False  # Mistral v11+: `text` is a JSON head made from `name[ARGS]`, then the arguments as written
    cleaner: _ArgsCleaner = field(default_factory=lambda: _ArgsCleaner())
    object_end: _JsonEnd = field(default_factory=_JsonEnd)
    args_end_at: _JsonEnd = field(default_factory=_JsonEnd)


class ToolCallParser:
    """Feed an answer's text; get `Parsed` pieces; `finish()` at the end. `calls` then holds every whole call
    (a call cut off by num_predict streamed its pieces but is not among them)."""

    def __init__(self, tools: list[Tool]):
        self._schemas = {t.function.name: t.function.parameters for t in tools}
        self._known = set(self._schemas)
        self._pending = ""  # text not decided yet
        self._held = ""  # text of a candidate call, given back as text if it is not one
        self._state = "text"  # text | value | array | close
        self._closer: str | None = None  # what ends the candidate: the closing tag, the fence, or nothing (bare)
        self._opener = ""  # what began it
        self._bare_allowed = True  # a bare JSON call may start here (the answer's start, or right after a call)
        self._call: _Call | None = None
        self._committed = 0  # calls of the current candidate already streamed
        self._colon = _ColonEnd("")  # where a Gemma call's arguments end
        self.calls: list[ToolCall] = []
        self.repairs: list[str] = []  # each near call made whole: its tool and what was wrong
        self._count = 0

    # ------------------------------------------------------------------------------------------------- feeding

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while self._pending and self._step(out, final=False):
            pass
        return out

    def finish(self, *, cut: bool = False) -> Parsed:
        """The end of the answer: decide what was held back. A call cut off after its head streamed keeps its pieces
        (and is not among `calls`). JSON that ended before it showed itself a call is text, unless the answer was
        `cut` (by max_tokens) while it may still have been one: a partial call is neither a call nor text."""
        out = Parsed()
        while self._pending and self._step(out, final=True):
            pass
        call = self._call
        if self._state in ("value", "array", "colon") and not self._committed and (call is None or call.id is None):
            if not (cut and self._may_be_call(call)):
                self._say(out, self._held + self._pending)
        self._pending, self._held = "", ""
        return out

    def _may_be_call(self, call: _Call | None) -> bool:
        """Whether a candidate cut off before its head was whole could still have been a call: its first key (when
        written) is one a call begins with, and its name (when written) an offered tool's."""
        if self._closer == TAG_CLOSE or call is None:
            return True
        key = _FIRST_KEY.match(call.text)
        if key is not None and key.group(1) not in ("name", "type", "function"):
            return False
        name = _NAME.search(call.text)
        return name is None or name.group(1) in self._known

    def _step(self, out: Parsed, *, final: bool) -> bool:
        """Consume what can be decided now; False when the rest must wait for more text."""
        if self._state == "text":
            return self._in_text(out, final)
        if self._state in ("value", "array"):
            return self._in_value(out)
        if self._state == "colon":
            return self._in_colon(out)
        return self._in_close(final)

    # ------------------------------------------------------------------------------------------------- text

    def _in_text(self, out: Parsed, final: bool) -> bool:
        text = self._pending
        if self._bare_allowed:  # at the answer's start or after a call, whitespace is no content
            text = self._pending = text.lstrip()
            if not text:
                return False
            for opener in PREFIX_OPENERS:
                if text.startswith(opener):
                    self._open(opener, text[len(opener) :], closer=None)
                    return True
                if opener.startswith(text) and not final:
                    return False  # maybe the opener, arriving
            if text[0] in "{[":
                self._open("", text, closer=None)
                return True
        start = self._marker(text)
        if start is None:
            hold = 0 if final else max(held_back(text, marker) for marker in _MARKERS)
            self._say(out, text[: len(text) - hold])
            self._pending = text[len(text) - hold :]
            return False
        self._say(out, text[:start])
        rest = text[start:]
        for opener, closer in TAGS.items():
            if rest.startswith(opener):
                self._open(opener, rest[len(opener) :], closer=closer)
                return True
        if rest.startswith(MISTRAL_OPENER):
            self._open(MISTRAL_OPENER, rest[len(MISTRAL_OPENER) :], closer=None)
            return True
        for opener, (closer, _) in COLON_CALLS.items():
            if rest.startswith(opener):
                self._open(opener, rest[len(opener) :], closer=closer)
                return True
        return self._fence(out, rest, final)

    @staticmethod
    def _marker(text: str) -> int | None:
        found = [i for i in (text.find(marker) for marker in _MARKERS) if i >= 0]
        return min(found) if found else None

    def _fence(self, out: Parsed, rest: str, final: bool) -> bool:
        """A fence opens a call when its language is JSON-like (or none) and its body starts with `{` or `[`."""
        head = _FENCE_HEAD.match(rest)
        assert head is not None
        lang = head.group(1)
        if head.end() == len(rest) and not final and len(lang) <= _MAX_FENCE_LANG:
            self._pending = rest
            return False  # the fence's language or its first line may still be arriving
        body = rest[head.end() :]
        if lang.lower() in _FENCE_LANGS and body[:1] in ("{", "["):
            self._open(rest[: head.end()], body, closer=FENCE)
            return True
        self._say(out, FENCE)
        self._pending = rest[len(FENCE) :]
        return True

    def _say(self, out: Parsed, text: str) -> None:
        if text:
            out.content += text
            if text.strip():
                self._bare_allowed = False

    def _open(self, opener: str, rest: str, *, closer: str | None) -> None:
        self._held, self._pending, self._opener = opener, rest, opener
        self._state, self._closer, self._committed, self._call = "value", closer, 0, None

    # ------------------------------------------------------------------------------------------------- values

    def _in_value(self, out: Parsed) -> bool:
        if self._call is None:
            return self._next_value(out)
        call = self._call
        end = call.object_end.feed(self._pending)
        taken = self._pending if end is None else self._pending[:end]
        self._pending = "" if end is None else self._pending[end:]
        self._held += taken
        call.text += taken
        out.deltas += self._stream(call)
        if end is None:
            return False
        if call.marked:
            call.text += "}"  # the arguments ended: so does the JSON call made of them
        self._call = None
        self._end_call(out, call)
        return True

    def _next_value(self, out: Parsed) -> bool:
        """Between values: the first `{` or `[` of the candidate, an array's next element or its end."""
        stripped = self._pending.lstrip()
        if not stripped:
            self._held, self._pending = self._held + self._pending, ""
            return False
        skipped = self._pending[: len(self._pending) - len(stripped)]
        ch = stripped[0]
        if self._state == "value" and ch == "[":
            self._state, self._held, self._pending = "array", self._held + skipped + ch, stripped[1:]
            return True
        if self._state == "array" and ch in ",]":
            self._held += skipped + ch
            self._pending = stripped[1:]
            if ch == "]":
                self._state = "close"
            return True
        if ch == "{":
            self._held += skipped
            self._pending = stripped
            self._call = _Call(index=self._count)
            return True
        self._held += skipped
        self._pending = stripped
        if self._state == "value" and not self._committed:
            if self._opener == MISTRAL_OPENER:
                return self._marked_head(out)
            if self._opener in COLON_CALLS:
                return self._colon_head(out)
        if self._committed:  # what follows calls already sent is not taken back: it is text after them
            self._state = "close"
        else:
            self._give_back(out)  # not a call after all
        return True

    def _marked_head(self, out: Parsed) -> bool:
        """Mistral v11+: `name[ARGS]` naming an offered tool, then `{`, opens a call whose arguments stream as
        the JSON form's do (its head made from the name); anything else after the opener is text."""
        head = _MARKED_HEAD.match(self._pending)
        if head is None:
            if _MARKED_SO_FAR.fullmatch(self._pending) and len(self._pending) < _MAX_HEAD:
                return False  # the head may still be arriving
            self._give_back(out)
            return True
        rest = self._pending[head.end() :]
        if not rest:
            return False  # the arguments' `{` is still to come
        if head.group(1) not in self._known or not rest.startswith("{"):
            self._give_back(out)
            return True
        self._held += self._pending[: head.end()]
        self._pending = rest
        self._call = _Call(index=self._count, text=f'{{"name": {json.dumps(head.group(1))}, "arguments": ', marked=True)
        return True

    def _colon_head(self, out: Parsed) -> bool:
        """Gemma: `call:name{` naming an offered tool opens a call, read whole before it is sent (its arguments are
        not JSON until they are); anything else after the opener is text."""
        head = _COLON_HEAD.match(self._pending)
        if head is None:
            if _COLON_SO_FAR.fullmatch(self._pending) and len(self._pending) < _MAX_HEAD:
                return False
            self._give_back(out)
            return True
        if head.group(1) not in self._known:
            self._give_back(out)
            return True
        self._held += self._pending[: head.end() - 1]
        self._pending = self._pending[head.end() - 1 :]
        self._call = _Call(index=self._count, name=head.group(1))
        self._state = "colon"
        self._colon = _ColonEnd(COLON_CALLS[self._opener][1])
        return True

    def _in_colon(self, out: Parsed) -> bool:
        """A Gemma call's arguments, up to the `}` that closes them: then a call, or text if they are no arguments."""
        call = self._call
        assert call is not None and call.name is not None
        call.text += self._pending
        self._held += self._pending
        self._pending = ""
        end = self._colon.scan(call.text)
        if end is None:
            return False
        extra = len(call.text) - end
        self._pending, call.text = call.text[end:], call.text[:end]
        self._held = self._held[: len(self._held) - extra]
        arguments = _colon_arguments(call.text, COLON_CALLS[self._opener][1])
        if arguments is None:
            self._give_back(out)
            return True
        call.id = _new_id()
        self._count += 1
        self._committed += 1
        out.deltas += [
            ToolCallDelta(index=call.index, id=call.id, name=call.name),
            ToolCallDelta(index=call.index, arguments=json.dumps(arguments)),
        ]
        self.calls.append(ToolCall(id=call.id, function=ToolCallFunction(name=call.name, arguments=arguments)))
        self._call, self._state = None, "close"
        return True

    def _stream(self, call: _Call) -> list[ToolCallDelta]:
        """The deltas the call's text so far makes known: its head once it is whole, then its arguments' text."""
        deltas: list[ToolCallDelta] = []
        if self._near():
            return deltas  # sent whole when it ends, if its arguments fit the tool: else it stays text
        if call.id is None:
            head = _CALL_HEAD.match(call.text)
            if head is None:
                return deltas
            name = json.loads(f'"{head.group(1)}"')
            if name not in self._known:
                return deltas  # maybe JSON that merely looks like a call: decided when it is whole
            call.id, call.name, call.args_start = _new_id(), name, head.end()
            self._count += 1
            self._committed += 1
            deltas.append(ToolCallDelta(index=call.index, id=call.id, name=name))
            end = call.args_end_at.feed(call.text[call.args_start :])
        elif call.args_end < 0:
            end = call.args_end_at.feed(call.text[call.args_start + call.sent :])
            end = None if end is None else call.sent + end
        else:
            return deltas
        if end is not None:
            call.args_end = call.args_start + end
        upto = call.args_end if call.args_end >= 0 else len(call.text)
        raw = call.text[call.args_start + call.sent : upto]
        call.sent += len(raw)
        fragment = call.cleaner.feed(raw)
        if fragment:
            deltas.append(ToolCallDelta(index=call.index, arguments=fragment))
        return deltas

    def _end_call(self, out: Parsed, call: _Call) -> None:
        """A call object is whole: keep it as a call, or, if it is none, give the candidate back as text."""
        found = _as_call(call.text, self._schemas, self._near())
        parsed = found[0] if found else None
        if call.id is None and parsed is None:
            if not self._committed:
                self._give_back(out)
                return
            # a stray element after real calls is dropped
        elif call.id is None and parsed is not None:
            call.id = _new_id()
            self._count += 1
            self._committed += 1
            out.deltas += [
                ToolCallDelta(index=call.index, id=call.id, name=parsed.function.name),
                ToolCallDelta(index=call.index, arguments=json.dumps(parsed.function.arguments)),
            ]
        if found is not None and call.id is not None:
            self.calls.append(ToolCall(id=call.id, function=found[0].function))
            if found[1]:
                self.repairs.append(f"{found[0].function.name}: {', '.join(found[1])}")
        if self._state == "value":
            self._state = "close"

    def _near(self) -> list[str]:
        """What about the candidate's wrapping is near, not right: said with the call it holds."""
        return [f"in {self._opener}"] if self._opener in NEAR_TAGS else []

    def _give_back(self, out: Parsed) -> None:
        held, self._held = self._held, ""
        self._state, self._call = "text", None
        self._say(out, held)
        self._bare_allowed = False

    # ------------------------------------------------------------------------------------------------- closing

    def _in_close(self, final: bool) -> bool:
        """After a call: its closing tag or fence (a missing one is forgiven), then text again."""
        stripped = self._pending.lstrip()
        closer = self._closer
        if closer and stripped.startswith(closer):
            self._pending = stripped[len(closer) :]
        elif closer and not final and closer.startswith(stripped):
            return False  # maybe the closer, arriving
        else:
            self._pending = stripped
        self._state, self._held, self._bare_allowed = "text", "", True
        return True


class _ColonEnd:
    """Finds where Gemma's `{key:value,...}` ends in text that grows: counts brackets outside `quote`d strings."""

    def __init__(self, quote: str) -> None:
        self._quote = quote
        self._pos = 0
        self._depth = 0
        self._inside = False

    def scan(self, text: str) -> int | None:
        """The index in `text` (all of it so far) just past the arguments' `}`, or None while they go on."""
        while self._pos < len(text):
            if text.startswith(self._quote, self._pos):
                self._inside = not self._inside
                self._pos += len(self._quote)
                continue
            if self._quote.startswith(text[self._pos :]):
                return None  # maybe a quote, arriving
            ch = text[self._pos]
            self._pos += 1
            if self._inside:
                continue
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._pos
        return None


_GEMMA_KEY = re.compile(r"([{,]\s*)([^\s:{}\[\],\x22]+)(\s*:)")


def _colon_arguments(text: str, quote: str) -> dict[str, Any] | None:
    """Gemma's `{key:<quote>text<quote>,n:1,...}` as JSON's object: strings quoted as JSON, bare keys quoted;
    None when it is no object."""
    parts = text.split(quote)
    if len(parts) % 2 == 0:
        return None  # a string left open
    pieces = [
        json.dumps(part) if i % 2 else _GEMMA_KEY.sub(lambda m: f"{m[1]}{json.dumps(m[2])}{m[3]}", part)
        for i, part in enumerate(parts)
    ]
    data = _json_or_none("".join(pieces))
    return data if isinstance(data, dict) else None


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


def _as_call(
    raw: str, schemas: Mapping[str, dict[str, Any] | None], near: list[str]
) -> tuple[ToolCall, list[str]] | None:
    """A call object's text as a call and what was repaired to make it one: {"name", "arguments"|"parameters"}
    (arguments may be a JSON string), or OpenAI's {"type": "function", "function": {...}}, naming a known tool.
    Trailing commas are dropped. A call in a near wrapper or with its arguments as a string (neither streamed as it
    goes) is one only if its arguments fit the tool's schema."""
    repairs = list(near)
    data = _json_or_none(raw)
    if data is None:
        cleaner = _ArgsCleaner()
        data = _json_or_none(cleaner.feed(raw))
        if data is None or not cleaner.dropped:
            return None
        repairs.append("trailing comma")
    if isinstance(data, dict) and isinstance(data.get("function"), dict):
        data = data["function"]
    if not isinstance(data, dict) or data.get("name") not in schemas:
        return None
    args: Any = data.get("arguments", data.get("parameters", {}))
    as_string = isinstance(args, str)
    if as_string:
        args = _json_or_none(args) if args.strip() else {}
        repairs.append("arguments as a string")
    if not isinstance(args, dict):
        return None
    if (near or as_string) and not _fits(args, schemas[data["name"]]):
        return None
    return ToolCall(id=_new_id(), function=ToolCallFunction(name=data["name"], arguments=args)), repairs


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _fits(args: dict[str, Any], schema: dict[str, Any] | None) -> bool:
    import jsonschema  # only a near call pays for it

    try:
        jsonschema.validate(args, schema or {"type": "object"})
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return True  # a schema the validator cannot read does not make a call wrong
    return True


def parse_tool_calls(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """A whole answer split into (content, calls): the streaming parser fed at once."""
    parser = ToolCallParser(tools)
    parsed = parser.feed(text)
    parsed += parser.finish()
    return parsed.content, parser.calls
