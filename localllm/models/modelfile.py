"""The Modelfile front end: Ollama's Modelfile text in, an `api.CreateRequest` out, and back again.

Grammar (Ollama's `parser/parser.go`, plus our DRAFT); instruction names are case-insensitive:

    # a comment line
    FROM smollm2:135m                  required: a model name or a path to a .gguf file
    FROM ./mmproj.gguf                 a second FROM: a vision projector (a `clip` GGUF), as in Ollama
    PARAMETER temperature 0.2          typed and checked against api.LoadOptions / api.SamplingOptions
    PARAMETER stop "<|im_end|>"        repeated `stop` lines accumulate into a list
    MESSAGE user "What is 2+2?"        role is system, user or assistant
    DRAFT smollm2:135m                 a draft model for speculative decoding (ours)
    ADAPTER ./lora.gguf 0.5            a GGUF LoRA adapter, with an optional scale (default 1; ours)

A value may be wrapped in double quotes or in triple double quotes, and then spans lines: it ends at the first line
whose text, with the surrounding blanks removed, ends with the closing quote. An unquoted value is the rest of its
line, stripped. Every error is a `ModelfileError` naming the line where the instruction starts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import api
from ..errors import InvalidInput, ModelfileError

log = logging.getLogger(__name__)

INSTRUCTIONS = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "MESSAGE", "ADAPTER", "LICENSE", "DRAFT")
# Ollama-only instructions: REQUIRES names a minimum Ollama version, so it has no meaning here and is skipped;
# RENDERER and PARSER name Go code built into Ollama that we do not have, so using one is an error.
SKIPPED_INSTRUCTIONS = frozenset({"REQUIRES"})
UNSUPPORTED_INSTRUCTIONS = frozenset({"RENDERER", "PARSER"})
MESSAGE_ROLES = ("system", "user", "assistant")
# Instructions that hold one value; saying one twice is almost always a copy-paste slip, so it is an error.
SINGLE_VALUED = frozenset({"TEMPLATE", "SYSTEM", "DRAFT"})
TRIPLE_QUOTE = '"""'


@dataclass(frozen=True)
class _Instruction:
    line: int
    name: str  # upper case
    args: str  # the raw text after the name, still quoted


# ---------------------------------------------------------------------------------------------------------- lexing


def _split_lines(text: str) -> list[str]:
    # Only \n, \r\n and \r end a line (as in Ollama); str.splitlines would also split on form feeds and the like.
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")


def _is_closed(value: str) -> bool:
    """Whether a (stripped) value is complete: unquoted, or its opening quote is matched at its end."""
    if value.startswith(TRIPLE_QUOTE):
        return len(value) >= 6 and value.endswith(TRIPLE_QUOTE)
    if value.startswith('"'):
        return len(value) >= 2 and value.endswith('"')
    return True


def _unquote(value: str) -> str:
    if value.startswith(TRIPLE_QUOTE):
        return value[3:-3]
    if value.startswith('"'):
        return value[1:-1]
    return value


def _split_first(text: str) -> tuple[str, str]:
    """Split `text` at its first run of blanks: ("word", "rest")."""
    parts = text.split(None, 1)
    return (parts[0], parts[1]) if len(parts) == 2 else (parts[0] if parts else "", "")


def _quoted_tail(args: str, instruction: str) -> str:
    """The part of an instruction's text that may open a quote (PARAMETER and MESSAGE have a name before it)."""
    return _split_first(args)[1] if instruction in ("PARAMETER", "MESSAGE") else args


def _read_instructions(text: str) -> Iterator[_Instruction]:
    """Yield each instruction with its raw (possibly multi-line) text, skipping blank and comment lines."""
    lines = _split_lines(text)
    index = 0
    while index < len(lines):
        start = index + 1
        line = lines[index].lstrip()
        index += 1
        if not line.strip() or line.startswith("#"):
            continue
        # Keep the line's trailing blanks: they belong to a quoted value that continues on the next line.
        name, args = _split_first(line)
        name = name.upper()
        # A quoted value runs on until the line that closes it, newlines included.
        while not _is_closed(tail := _quoted_tail(args, name).strip()):
            if index == len(lines):
                quote = TRIPLE_QUOTE if tail.startswith(TRIPLE_QUOTE) else '"'
                raise ModelfileError(
                    start, f"unterminated {quote} in {name}: no closing {quote} before the end of the file"
                )
            args += "\n" + lines[index]
            index += 1
        yield _Instruction(start, name, args.strip())


# ---------------------------------------------------------------------------------------------------------- values


def _parse_value(ins: _Instruction, raw: str) -> str:
    if not raw.strip():
        raise ModelfileError(ins.line, f"{ins.name} needs a value")
    return _unquote(raw.strip())


def validate_parameter(name: str, value: str, *, line: int) -> Any:
    """Convert one PARAMETER value to its option's type, or raise a ModelfileError naming the line.

    Returns the typed value (for `stop`, the single string), or None for an Ollama option we accept and ignore."""
    try:
        typed = api.parse_option(name, value)
    except InvalidInput as exc:
        raise ModelfileError(line, exc.message) from None
    if typed is None:
        # Accepted so that Modelfiles written for Ollama still load, but said out loud: it changes nothing here.
        log.warning("Modelfile line %d: parameter %s has no effect in localllm; ignored", line, name)
    return typed


# ---------------------------------------------------------------------------------------------------------- parsing


@dataclass
class _Collected:
    """What the instructions said so far; `seen` remembers the line of each single-valued instruction."""

    fields: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[api.Message] = field(default_factory=list)
    licenses: list[str] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)
    adapter_scales: dict[str, float] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)


def _add_single(ins: _Instruction, collected: _Collected) -> None:
    if ins.name in collected.seen:
        raise ModelfileError(ins.line, f"{ins.name} given twice (first on line {collected.seen[ins.name]})")
    collected.seen[ins.name] = ins.line
    key = {"TEMPLATE": "template", "SYSTEM": "system", "DRAFT": "draft"}[ins.name]
    collected.fields[key] = _parse_value(ins, ins.args)


def _add_parameter(ins: _Instruction, collected: _Collected) -> None:
    name, raw = _split_first(ins.args)
    if not name:
        raise ModelfileError(ins.line, "PARAMETER needs a name and a value: PARAMETER name value")
    if not raw.strip():
        raise ModelfileError(ins.line, f"PARAMETER {name} needs a value: PARAMETER {name} value")
    value = validate_parameter(name, _parse_value(ins, raw), line=ins.line)
    if name == "stop":
        collected.parameters.setdefault("stop", []).append(value)
    elif value is not None:
        collected.parameters[name] = value


def _add_message(ins: _Instruction, collected: _Collected) -> None:
    role, raw = _split_first(ins.args)
    if role not in MESSAGE_ROLES:
        raise ModelfileError(ins.line, f"MESSAGE role {role!r} must be one of {', '.join(MESSAGE_ROLES)}")
    if not raw.strip():
        raise ModelfileError(ins.line, f'MESSAGE {role} needs a text (write "" for an empty one)')
    collected.messages.append(api.Message(role=role, content=_unquote(raw.strip())))


def _add_from(ins: _Instruction, collected: _Collected) -> None:
    """The first FROM is the model; a second one is its vision projector (Ollama's way to pair a model with one)."""
    if "PROJECTOR" in collected.seen:
        raise ModelfileError(
            ins.line,
            f"FROM given three times (lines {collected.seen['FROM']} and {collected.seen['PROJECTOR']}): "
            "a model takes one FROM for its weights and at most one more for a vision projector",
        )
    key = "projector" if "FROM" in collected.seen else "from_"
    collected.seen["PROJECTOR" if key == "projector" else "FROM"] = ins.line
    collected.fields[key] = _parse_value(ins, ins.args)


def _add_instruction(ins: _Instruction, collected: _Collected) -> None:
    if ins.name == "FROM":
        _add_from(ins, collected)
    elif ins.name in SINGLE_VALUED:
        _add_single(ins, collected)
    elif ins.name == "PARAMETER":
        _add_parameter(ins, collected)
    elif ins.name == "MESSAGE":
        _add_message(ins, collected)
    elif ins.name == "LICENSE":
        collected.licenses.append(_parse_value(ins, ins.args))
    elif ins.name == "ADAPTER":
        _add_adapter(ins, collected)
    elif ins.name in UNSUPPORTED_INSTRUCTIONS:
        raise ModelfileError(
            ins.line,
            f"{ins.name} names a renderer built into Ollama; localllm does not support "
            "it (remove the line; the model's own chat template is used)",
        )
    elif ins.name not in SKIPPED_INSTRUCTIONS:
        raise ModelfileError(ins.line, f"unknown instruction {ins.name!r}; expected one of {', '.join(INSTRUCTIONS)}")


def _add_adapter(ins: _Instruction, collected: _Collected) -> None:
    """ADAPTER path [scale]: keys are the paths as written; values are their digests, filled in when stored."""
    path, scale = _parse_value(ins, ins.args), None
    words = ins.args.rsplit(None, 1)
    tail = words[-1]
    if len(words) == 2 and not ins.args.startswith('"'):
        try:
            scale = float(tail)
        except ValueError:
            pass  # a path with a blank in it
        else:
            path = words[0].strip()
    if scale is not None:
        if not -api.ADAPTER_SCALE_LIMIT <= scale <= api.ADAPTER_SCALE_LIMIT:
            raise ModelfileError(
                ins.line,
                f"ADAPTER scale {tail} is outside -{api.ADAPTER_SCALE_LIMIT:g}.."
                f"{api.ADAPTER_SCALE_LIMIT:g} (1 applies the adapter as trained)",
            )
        collected.adapter_scales[path] = scale
    collected.adapters[path] = ""


def _license_field(licenses: list[str]) -> str | list[str] | None:
    if not licenses:
        return None
    return licenses[0] if len(licenses) == 1 else licenses


def parse_modelfile(text: str) -> api.CreateRequest:
    """Parse Modelfile text into a CreateRequest whose `model` is "" (the caller names the model).

    Args:
        text: the Modelfile's contents.
    Returns:
        The request: `from_`, `parameters` typed as in api.LoadOptions / api.SamplingOptions (`stop` a list),
        `messages`, `license` (a string, or a list when LICENSE is repeated), `adapters` (path -> "" digest), `draft`,
        `projector` (a second FROM).
    Raises:
        ModelfileError: naming the line of the first problem.
    """
    collected = _Collected()
    for ins in _read_instructions(text):
        _add_instruction(ins, collected)
    if "FROM" not in collected.seen:
        # Line 1: where the FROM belongs.
        raise ModelfileError(
            1, "no FROM line: a Modelfile must say which model it builds on (FROM name or FROM ./file.gguf)"
        )
    return api.CreateRequest(
        model="",
        parameters=collected.parameters,
        messages=collected.messages,
        license=_license_field(collected.licenses),
        adapters=collected.adapters,
        adapter_scales=collected.adapter_scales,
        **collected.fields,
    )


# ---------------------------------------------------------------------------------------------------------- rendering


def _needs_quotes(value: str) -> bool:
    return value == "" or "\n" in value or value != value.strip() or value.startswith('"')


def _closes_early(quoted: str) -> bool:
    """Whether the parser would end this quoted text before its last line (a line inside ends with the quote)."""
    lines = quoted.split("\n")
    return any(_is_closed("\n".join(lines[:end]).strip()) for end in range(1, len(lines)))


def quote_value(value: str, *, what: str = "value") -> str:
    """Quote `value` so that parse_modelfile reads back exactly `value` (line endings become \\n).

    Raises:
        InvalidInput: for the rare text no quoting can carry (a line inside it ends with \"\"\").
    """
    value = value.replace("\r\n", "\n").replace("\r", "\n")
    if not _needs_quotes(value):
        return value
    quoted = f'"{value}"' if '"' not in value else f"{TRIPLE_QUOTE}{value}{TRIPLE_QUOTE}"
    if _closes_early(quoted):
        raise InvalidInput(
            f"{what} {value[:40]!r} cannot be written in a Modelfile: a line inside it ends with {TRIPLE_QUOTE}"
        )
    return quoted


def _render_adapter(path: str, scale: float) -> str:
    if scale == 1.0:
        return f"ADAPTER {quote_value(path, what='ADAPTER')}"
    if _needs_quotes(path) or " " in path:
        raise InvalidInput(
            f"adapter {path!r} with scale {scale:g} cannot be written in a Modelfile",
            hint="give the adapter file a name without blanks",
        )
    return f"ADAPTER {path} {scale:g}"


def _render_parameter(name: str, value: Any) -> Iterator[str]:
    for item in value if isinstance(value, list) else [value]:
        text = ("true" if item else "false") if isinstance(item, bool) else str(item)
        yield f"PARAMETER {name} {quote_value(text, what=f'parameter {name}')}"


def _message_parts(message: api.Message | Mapping[str, Any]) -> tuple[str, str]:
    if isinstance(message, api.Message):
        return message.role, message.content
    return message["role"], message.get("content", "")


def _as_list(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def render_modelfile(
    *,
    from_: str,
    projector: str | None = None,
    template: str | None = None,
    system: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    messages: Iterable[api.Message | Mapping[str, Any]] = (),
    license: str | Iterable[str] | None = None,
    draft: str | None = None,
    adapters: Mapping[str, str] | Iterable[str] | None = None,
    adapter_scales: Mapping[str, float] | None = None,
) -> str:
    """Write a Modelfile that parse_modelfile reads back to the same request.

    Args:
        from_: the FROM model name or path.
        projector: a vision projector's path, written as a second FROM.
        parameters: option name -> value (a list for `stop`).
        messages: api.Message values or {"role", "content"} dicts.
        license: one text or several (one LICENSE instruction each).
        adapters: adapter paths (a mapping's keys are used).
        adapter_scales: adapter path -> scale, for those not applied at scale 1.
    Returns:
        The Modelfile text, one instruction per line (multi-line values quoted).
    """
    lines = [f"FROM {quote_value(from_, what='FROM')}"]
    if projector is not None:
        lines.append(f"FROM {quote_value(projector, what='FROM')}")
    if draft is not None:
        lines.append(f"DRAFT {quote_value(draft, what='DRAFT')}")
    lines += [_render_adapter(path, (adapter_scales or {}).get(path, 1.0)) for path in _as_list(adapters)]
    if template is not None:
        lines.append(f"TEMPLATE {quote_value(template, what='TEMPLATE')}")
    if system is not None:
        lines.append(f"SYSTEM {quote_value(system, what='SYSTEM')}")
    for name, value in (parameters or {}).items():
        lines += _render_parameter(name, value)
    for message in messages:
        role, content = _message_parts(message)
        lines.append(f"MESSAGE {role} {quote_value(content, what=f'MESSAGE {role}')}")
    lines += [f"LICENSE {quote_value(text, what='LICENSE')}" for text in _as_list(license)]
    return "\n".join(lines) + "\n"
