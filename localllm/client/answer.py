"""An answer on its way out: engine chunks become api chunks. Thinking is split from content, the stop string that
ended the answer is named, tool calls stream as they are parsed, and the last chunk carries Ollama's timings."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .. import api
from ..chat.thinking import Split, Think, ThinkingSplitter, opens_thinking, supports_thinking, thinking_grammar
from ..chat.tool_calls import ToolCallParser
from ..engine.runner import EngineChunk

TokenBytes = Callable[[int], bytes]


class Answer:
    """One answer on its way out: its thinking split from its content, and which stop string ended it."""

    def __init__(
        self,
        token_bytes: TokenBytes,
        splitter: ThinkingSplitter | None,
        thinks: bool,
        stops: list[str],
        prompt_tokens: int = 0,
    ):
        self.token_bytes = token_bytes
        self._prompt_tokens = prompt_tokens
        self._splitter = splitter
        self._thinks = thinks
        self._stops = sorted(s for s in stops if s)
        self._text: list[str] = []
        self._tokens: list[int] = []
        self.stop_sequence: str | None = None

    @classmethod
    def start(
        cls,
        token_bytes: TokenBytes,
        template: str | None,
        prompt: str,
        think: Think,
        stops: list[str],
        *,
        prompt_tokens: int = 0,
    ) -> Answer:
        # A reasoning model's tags are always split off, even when thinking was turned off and it thinks anyway.
        capable = supports_thinking(template)
        splitter = ThinkingSplitter(opened=opens_thinking(prompt)) if capable else None
        return cls(token_bytes, splitter, capable and think.enabled is not False, stops, prompt_tokens)

    def announce(self) -> int:
        """The prompt's length the first time, 0 after."""
        count, self._prompt_tokens = self._prompt_tokens, 0
        return count

    @property
    def thinks(self) -> bool:
        """Whether the answer may begin with a think block (where a call's trigger is no call)."""
        return self._splitter is not None

    def grammar(self, grammar: str | None) -> str | None:
        """Structured output on a thinking answer applies after the think block (as Ollama does)."""
        if grammar is None or not self._thinks or self._splitter is None:
            return grammar
        return thinking_grammar(grammar, opened=self._splitter.thinking)

    def feed(self, chunk: EngineChunk) -> Split:
        self._text.append(chunk.text)
        self._tokens.extend(chunk.tokens)
        if self._splitter is None:
            split = Split(content=chunk.text)
        else:
            split = self._splitter.feed(chunk.text)
            if chunk.done:
                tail = self._splitter.flush()
                split = Split(split.thinking + tail.thinking, split.content + tail.content)
        if chunk.done and chunk.done_reason == "stop" and self._stops:
            self.stop_sequence = self._matched_stop()
        return split

    def logprobs(self, chunk: EngineChunk) -> list[api.TokenLogprob] | None:
        if not chunk.logprobs:
            return None

        def entry(token: int, logprob: float) -> dict:
            raw = self.token_bytes(token)
            return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

        return [
            api.TokenLogprob(**entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in chunk.logprobs
        ]

    def _matched_stop(self) -> str | None:
        # The engine hides the stop string; what the answer's tokens spell beyond the text shown begins with it.
        spelled = b"".join(self.token_bytes(t) for t in self._tokens).decode("utf-8", "replace")
        rest = spelled[len("".join(self._text)) :]
        return next((s for s in self._stops if rest.startswith(s)), None)


def timing_fields(chunk: EngineChunk, load_seconds: float) -> dict[str, Any]:
    """Ollama's timings, adding up: load (getting the model ready, a load included) + prompt_eval (templating,
    tokenizing, waiting for a slot and the whole prefill, up to the first sampled token) + eval = total."""
    timings = chunk.timings.model_dump() if chunk.timings else {}
    load_ns = int(load_seconds * 1e9)
    timings["load_duration"] = load_ns
    timings["total_duration"] = timings.get("total_duration", 0) + load_ns
    return timings


def generate_chunk(
    name: str, chunk: EngineChunk, answer: Answer, load_seconds: float, context: list[int] | None
) -> api.GenerateChunk:
    split = answer.feed(chunk)
    if not chunk.done:
        return api.GenerateChunk(
            model=name,
            response=split.content,
            thinking=split.thinking or None,
            tokens=list(chunk.tokens),
            logprobs=answer.logprobs(chunk),
        )
    return api.GenerateChunk(
        model=name,
        response=split.content,
        thinking=split.thinking or None,
        done=True,
        done_reason=chunk.done_reason,
        context=context,
        stop_sequence=answer.stop_sequence,
        **timing_fields(chunk, load_seconds),
    )


def chat_chunk(name: str, chunk: EngineChunk, answer: Answer, load_seconds: float) -> api.ChatChunk:
    split = answer.feed(chunk)
    message = api.Message(role="assistant", content=split.content, thinking=split.thinking or None)
    if not chunk.done:
        # The first chunk also says how long the prompt is, for streams that announce it before the answer
        # (Anthropic's message_start); Ollama's NDJSON leaves timing fields off all but the last chunk.
        prompt = answer.announce()
        return api.ChatChunk(
            model=name,
            message=message,
            tokens=list(chunk.tokens),
            logprobs=answer.logprobs(chunk),
            prompt_eval_count=prompt,
            prompt_cache_count=chunk.cached if prompt else 0,
        )
    return api.ChatChunk(
        model=name,
        message=message,
        done=True,
        done_reason=chunk.done_reason,
        stop_sequence=answer.stop_sequence,
        **timing_fields(chunk, load_seconds),
    )


def chat_with_tools(
    name: str, stream: Iterable[EngineChunk], answer: Answer, load_seconds: float, tools: list[api.Tool]
) -> Iterator[api.ChatChunk]:
    """An answer that may call tools (chat/tool_calls.py): text that may begin a call is held until decided, calls
    stream as deltas (id and name, then pieces of the arguments), and each whole call comes in the chunk where it
    ended (as Ollama streams calls). A forced call (its grammar's bare JSON) is parsed the same way."""
    parser = ToolCallParser(tools)
    shown = 0  # calls already sent whole
    for chunk in stream:
        split = answer.feed(chunk)
        parsed = parser.feed(split.content)
        if chunk.done:
            parsed += parser.finish(cut=chunk.done_reason == "length")
        calls, shown = parser.calls[shown:], len(parser.calls)
        message = api.Message(
            role="assistant", content=parsed.content, thinking=split.thinking or None, tool_calls=calls or None
        )
        common = {"model": name, "message": message, "tool_call_deltas": parsed.deltas or None}
        if not chunk.done:
            yield api.ChatChunk(
                **common,
                tokens=list(chunk.tokens),
                logprobs=answer.logprobs(chunk),
                prompt_eval_count=answer.announce(),
            )
            continue
        yield api.ChatChunk(
            **common,
            done=True,
            done_reason=chunk.done_reason,
            stop_sequence=answer.stop_sequence,
            repairs=parser.repairs or None,
            **timing_fields(chunk, load_seconds),
        )
