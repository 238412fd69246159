"""Claude Code's billing line, neutralised before templating.

Claude Code starts the system prompt of every request with a line such as
`x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch=36ee5;` whose `cch` value changes with
each request. Anthropic's API lifts it out before the model sees it; left in, it sits ~40 tokens into a prompt that is
otherwise byte-identical turn to turn, and our prefix cache could reuse only those first tokens. vLLM drops the block,
llama.cpp's server fixes the value; we drop the line, so the model sees what Anthropic's models see.

Only that exact form is matched (the header name, then `key=value;` pairs, nothing else on the line), and only at the
start of a system prompt: a user who writes about the header anywhere else keeps every byte."""

from __future__ import annotations

import logging
import re

from .. import api

log = logging.getLogger(__name__)

# The header name, one or more `key=value;` pairs (values hold no `;` or newline), then the end of the line, or, with
# no space between, the next system block's text (a proxy that joined the blocks without a separator).
_BILLING_LINE = re.compile(
    r"\Ax-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]+=[^;\r\n]*;)+(?:[ \t]*(?:\r?\n)+|[ \t]*\Z|(?=\S))"
)


def strip_billing_header(text: str) -> str:
    """`text` without a leading billing line (unchanged when it has none)."""
    if not text.startswith("x-anthropic-billing-header:"):
        return text
    stripped = _BILLING_LINE.sub("", text, count=1)
    if stripped != text:
        log.debug("left out Claude Code's billing line from the system prompt")
    return stripped


def without_billing_header(messages: list[api.Message]) -> list[api.Message]:
    """System messages without a leading billing line; one that held only the line is left out."""
    out = []
    for message in messages:
        if message.role == "system" and message.content.startswith("x-anthropic-billing-header:"):
            content = strip_billing_header(message.content)
            if not content and content != message.content:
                continue
            message = message.model_copy(update={"content": content})
        out.append(message)
    return out
