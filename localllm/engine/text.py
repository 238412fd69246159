"""Turning generated tokens into text: UTF-8 safe across token boundaries, and stop strings that never leak.

A token can end in the middle of a multi-byte character, so bytes go through an incremental decoder that holds the
partial character back. Text that might be the start of a stop string is held back too, until it either completes
the stop string (generation ends, the stop string is not shown) or stops matching (it is released)."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..chat.thinking import held_back


@dataclass
class TextDelta:
    text: str
    stopped: bool = False


def make_stop_matcher(stops: Sequence[str]) -> Callable[[str, bool], TextDelta]:
    """Returns feed(pending_text, final) -> TextDelta; `pending_text` is everything not yet released."""
    stops = [s for s in stops if s]
    if not stops:
        return lambda pending, final: TextDelta(pending)

    def feed(pending: str, final: bool) -> TextDelta:
        hits = [(pending.find(s), s) for s in stops if s in pending]
        if hits:
            cut = min(hits)[0]
            return TextDelta(pending[:cut], stopped=True)
        if final:
            return TextDelta(pending)
        hold = max((held_back(pending, s) for s in stops), default=0)
        return TextDelta(pending[: len(pending) - hold])

    return feed


class TextStream:
    """Feed tokens, get released text. One per request, used only on the engine thread."""

    def __init__(self, token_bytes: Callable[[int], bytes], stops: Sequence[str]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._match = make_stop_matcher(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, token: int) -> str:
        self._pending += self._decoder.decode(self._token_bytes(token))
        return self._release(final=False)

    def flush(self) -> str:
        """Release what is held back at the end of generation (a partial stop string, a dangling byte)."""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        delta = self._match(self._pending, final)
        self.stopped = delta.stopped
        self._pending = "" if delta.stopped else self._pending[len(delta.text) :]
        return delta.text
