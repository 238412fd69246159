"""JSON schema to GBNF, bounded: every schema a request brings (format, response_format, tools' parameters,
output_format, text.format) is checked against fixed bounds before any grammar is built, and converted with
repetition written as GBNF's `x{m,n}` (llama.cpp expands it natively) rather than spelled out item by item.

The converter is llama-cpp-python's port of llama.cpp's json-schema-to-grammar, with two corrections from llama.cpp's
current C++ converter: `{m,n}` repetition, and a string character that excludes control characters, so that what the
grammar allows is always valid JSON (a raw newline inside a JSON string is not)."""

from __future__ import annotations

import json
import re
from typing import Any

from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, BuiltinRule, SchemaConverter

from ..errors import InvalidInput

# llama.cpp's grammar parser refuses more repetitions than this (MAX_REPETITION_THRESHOLD in llama-grammar.cpp).
MAX_REPEAT = 2000
MAX_DEPTH = 32  # nesting of the schema's JSON
MAX_NODES = 20_000  # objects, arrays and values in the schema
MAX_ENUM = 1000  # values of one enum
MAX_PROPERTIES = 1000  # properties of one object
MAX_SCHEMA_CHARS = 256 * 1024  # the schema as JSON text
MAX_GRAMMAR_CHARS = 1024 * 1024  # the grammar built from it
MAX_EXPANSION = 100_000  # rules llama.cpp's parser writes out for all `{m,n}` together
REPEAT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_REPEATED = re.compile(r"[\w\])]\{(\d+),?(\d*)\}")  # a `{m,n}` after a rule, class or group in GBNF
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")
_HINT = "make the schema smaller: localllm bounds schemas so that a grammar's size and build time stay small"

# JSON's own string character (RFC 8259): no quote, no backslash, no control character; escapes as JSON spells them.
JSON_CHAR = BuiltinRule(r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})', [])
# A regex `.` inside a JSON string: any character the string may hold unescaped.
JSON_DOT = r'[^"\\\x7F\x00-\x1F]'


def schema_grammar(schema: Any, where: str = "schema") -> str:
    """The GBNF for `schema`, or InvalidInput (400) naming the bound it passes or why it cannot be expressed."""
    check_schema(schema, where)
    converter = BoundedConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        converter.visit(converter.resolve_refs(schema, "schema"), "")
    except (ValueError, AssertionError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        # the converter signals what it cannot express with bare exceptions
        raise InvalidInput(f"the JSON schema cannot be turned into a grammar: {exc}") from None
    grammar = converter.format_grammar()
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidInput(
            f"the JSON schema's grammar is {len(grammar)} characters, over the bound of {MAX_GRAMMAR_CHARS}",
            hint=_HINT,
        )
    expansion = sum(int(top or low) for low, top in _REPEATED.findall(grammar))
    if expansion > MAX_EXPANSION:
        raise InvalidInput(
            f"the JSON schema's repetitions add up to {expansion} grammar rules, over the bound of {MAX_EXPANSION}",
            hint=_HINT,
        )
    return grammar


def check_schema(schema: Any, where: str = "schema") -> None:
    """Bounds checked by a walk over the schema's JSON (`where` names it in errors), before the converter sees it."""
    _walk_schema(schema, where, keywords=True)


def check_schema_shape(schema: Any, where: str = "schema") -> None:
    """The bounds on any schema a request brings (an object of plain JSON, its size, nesting and values), without
    those that only a grammar needs (repetition counts, enum and property counts, patterns)."""
    _walk_schema(schema, where, keywords=False)


def _walk_schema(schema: Any, where: str, *, keywords: bool) -> None:
    if not isinstance(schema, dict):
        raise InvalidInput(f"{where}: a JSON schema must be an object, not {type(schema).__name__}")
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError):
        raise InvalidInput(f"{where}: the JSON schema is not plain JSON") from None
    if size > MAX_SCHEMA_CHARS:
        raise InvalidInput(
            f"{where}: the JSON schema is {size} characters, over the bound of {MAX_SCHEMA_CHARS}", hint=_HINT
        )
    stack: list[tuple[Any, int, str]] = [(schema, 1, where)]
    nodes = 0
    while stack:
        node, depth, where = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise InvalidInput(f"{where}: the JSON schema has more than {MAX_NODES} values, over the bound", hint=_HINT)
        if depth > MAX_DEPTH:
            raise InvalidInput(f"the JSON schema nests deeper than {MAX_DEPTH} levels at {where}", hint=_HINT)
        if isinstance(node, dict):
            if keywords:
                _check_keywords(node, where)
            stack.extend((value, depth + 1, f"{where}.{key}") for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, depth + 1, f"{where}[{i}]") for i, value in enumerate(node))


def _check_keywords(node: dict[str, Any], where: str) -> None:
    for key in REPEAT_KEYS:
        if key in node:
            _check_count(node[key], f"{where}.{key}")
    for low, high in zip(REPEAT_KEYS[::2], REPEAT_KEYS[1::2], strict=True):
        # llama.cpp's parser counts max - min repetitions unsigned: min above max would never end
        if low in node and high in node and node[low] > node[high]:
            raise InvalidInput(f"{where}.{low} {node[low]} is more than {high} {node[high]}")
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_ENUM:
        raise InvalidInput(f"{where}.enum has {len(enum)} values, over the bound of {MAX_ENUM}", hint=_HINT)
    properties = node.get("properties")
    if isinstance(properties, dict) and len(properties) > MAX_PROPERTIES:
        raise InvalidInput(
            f"{where}.properties has {len(properties)} properties, over the bound of {MAX_PROPERTIES}", hint=_HINT
        )
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        for match in _QUANTIFIER.finditer(pattern):
            low, high = match.groups()
            if low and high and int(low) > int(high):
                raise InvalidInput(f"{where}.pattern repeats {match.group(0)}: its minimum is more than its maximum")
            for number in match.groups():
                if number and int(number) > MAX_REPEAT:
                    raise InvalidInput(
                        f"{where}.pattern repeats {match.group(0)}, over the bound of {MAX_REPEAT} repetitions",
                        hint=_HINT,
                    )


def _check_count(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"{where} is {value!r}: it must be a non-negative integer")
    if value > MAX_REPEAT:
        raise InvalidInput(f"{where} {value} is over the bound of {MAX_REPEAT}", hint=_HINT)


def repetition(item: str, min_items: int, max_items: int | None) -> str:
    """The rule `item` repeated min..max times (max None: no upper bound) in GBNF's own repetition, `item{m,n}`.
    `item` is one rule's name: llama.cpp bounds a repeated group by the rules it holds times the count."""
    if max_items == 0:
        return ""
    if (min_items, max_items) == (0, 1):
        return f"{item}?"
    if max_items is None:
        return {0: f"{item}*", 1: f"{item}+"}.get(min_items, f"{item}{{{min_items},}}")
    return f"{item}{{{min_items},{max_items}}}"


class BoundedConverter(SchemaConverter):
    """llama-cpp-python's converter with arrays and strings repeated by `{m,n}` and JSON-valid string characters."""

    def visit(self, schema: Any, name: str) -> str:
        if not isinstance(schema, dict):
            raise ValueError(f"a subschema must be an object, not {json.dumps(schema)[:80]}")
        rule_name = f"{name}-" if name in RESERVED_NAMES else name or "root"
        kind = schema.get("type")
        plain = not any(k in schema for k in ("$ref", "oneOf", "anyOf", "const", "enum", "pattern", "format"))
        items = schema.get("items")
        if plain and kind in (None, "array") and isinstance(items, dict) and "prefixItems" not in schema:
            item = self.visit(items, f"{name}{'-' if name else ''}item")
            body = self._separated(item, schema.get("minItems", 0), schema.get("maxItems"))
            return self._add_rule(rule_name, f'"[" space {body} "]" space')
        if plain and kind == "string" and ("minLength" in schema or "maxLength" in schema):
            char = self._add_primitive("char", PRIMITIVE_RULES["char"])
            body = repetition(char, schema.get("minLength", 0), schema.get("maxLength"))
            return self._add_rule(rule_name, rf'"\"" {body} "\"" space')
        return super().visit(schema, name)

    def _separated(self, item: str, min_items: int, max_items: int | None) -> str:
        """`item` min..max times, separated by commas. Every repeated or optional part is one rule: llama.cpp
        bounds a repeated group by the rules it holds times the count, which a group around `{m,n}` would pass."""
        if max_items == 0:
            return ""
        next_item = self._add_rule(f"{item}-next", f'"," space {item}')
        rest = repetition(next_item, max(min_items - 1, 0), None if max_items is None else max_items - 1)
        seq = f"{item} {rest}".rstrip()
        return seq if min_items > 0 else f"{self._add_rule(f'{item}-list', seq)}?"

    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        return super()._add_primitive(name, JSON_CHAR if name == "char" else rule)

    def _add_rule(self, name: str, rule: str) -> str:
        return super()._add_rule(name, JSON_DOT if name == "dot" else rule)
