"""The agents section of scripts/bench.py: Claude Code's real first request, two turns, ours against llama-server's.

The request is tests/data/claude_code_first_request.json, Claude Code's first /v1/messages request as its binary sent
it (24 tools, a mid-conversation system message), or with `--agent-tools` only the tools named, as `claude --tools`
sends it (the agent-types system message goes with the Agent tool). Each repeat starts each server fresh, one at a
time, the two taking turns first: `localllm serve` on a private home (no prefix cache on disk or in RAM) and
`llama-server -m MODEL`, both at their defaults. After a 4-token warm-up on raw text that shares no token with the
request, each server gets:

    turn 1   the request, streamed, greedy, ANSWER_TOKENS tokens at most (a cold prefill)
    turn 2   turn 1's messages, the assistant's answer as turn 1 streamed it (with a tool result for each tool call),
             and a short user message: the prefix cache's turn

Per turn, on the client's clock: time to first event (any SSE event: ours sends message_start before the prefill,
llama-server with the first token), time to first token (the first content delta or tool_use block), and the prompt
tokens the server says it reused (`cache_read_input_tokens`, which llama-server's /v1/messages reports in
message_start too). The figures are medians of the repeats; each repeat's ratios are in the notes.

    python scripts/bench.py --models qwen2.5-coder:1.5b --only agents --llama-server PATH
    python scripts/bench.py ... --only agents --agent-tools Read,Write,Bash   # ~2.9K tokens, a quicker run
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.bench import rest
from localllm.bench.figures import Figure

REQUEST = Path(__file__).resolve().parent.parent / "tests" / "data" / "claude_code_first_request.json"
REPEATS = 2  # when called on its own; bench.py passes its --repeats
ANSWER_TOKENS = 32
FOLLOW_UP = "Thanks. In one sentence, what can you help me with in this project?"
TTFT_TARGET = 1.05  # ours / llama-server's, at most
TURN_TIMEOUT = 3600.0  # seconds a turn may take in all: an 18.8K-token prefill on 2 cores takes minutes
START_TIMEOUT = 300.0  # seconds llama-server may take to answer /health
WARM_UP = "Say hello."  # raw text: its first token is not the template's, so no prefix of the request is cached
# Settings a user has not made at the defaults: the environment this script runs in must not set them for our server.
PINNED = ("LOCALLLM_NUM_THREAD", "LOCALLLM_CONTEXT_LENGTH", "LOCALLLM_NUM_PARALLEL")

Body = dict[str, Any]


@dataclass
class Turn:
    """One streamed /v1/messages request on the client's clock, and what the server reported in its events."""

    submitted: float
    first_event: float = math.nan
    first_token: float = math.nan
    usage: dict[str, int] = field(default_factory=dict)
    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)  # the answer's content blocks, by index
    partial_json: dict[int, str] = field(default_factory=dict)  # each tool_use block's streamed input

    def ttfe(self) -> float:
        return self.first_event - self.submitted

    def ttft(self) -> float:
        return self.first_token - self.submitted

    def reused(self) -> int:
        return self.usage.get("cache_read_input_tokens", 0)

    def prompt(self) -> int:
        return self.usage.get("input_tokens", 0) + self.reused()

    def content(self) -> list[dict[str, Any]]:
        """The answer as content blocks to send back: tool inputs parsed, empty text blocks left out."""
        out = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            if block["type"] == "tool_use":
                block = {**block, "input": _parsed(self.partial_json.get(index, ""), block.get("input"))}
            if block["type"] != "text" or block.get("text"):
                out.append(block)
        return out or [{"type": "text", "text": "(no answer)"}]


@dataclass
class Conversation:
    """Both turns of one server in one repeat, with the prompt size it counted for turn 1."""

    first: Turn
    second: Turn
    counted: int | None
    context: int | None


@dataclass
class Repeat:
    ours: Conversation
    theirs: Conversation
    ours_first: bool


def agent_figures(
    path: Path,
    *,
    llama_server: str | None,
    tools: Sequence[str] | None = None,
    repeats: int = REPEATS,
    log: Callable[[str], None] = print,
) -> list[Figure]:
    if not llama_server:
        log("no llama-server binary (LLAMA_SERVER=$(bash scripts/build_llama_server.sh)): the agents section needs it")
        return []
    if repeats < 1:
        raise ValueError(f"agents section: repeats {repeats} must be >= 1")
    for name in PINNED:
        os.environ.pop(name, None)  # defaults: nothing set, for the servers served_model starts below
    body = agent_request(tools)
    shape = f"{len(body['tools'])} tools" + (f" ({', '.join(tools)})" if tools else ", the whole request")
    runs = []
    for r in range(repeats):
        ours_first = r % 2 == 0
        order = ("ours", "llama-server") if ours_first else ("llama-server", "ours")
        done: dict[str, Conversation] = {}
        for name in order:
            log(f"agents: {shape}, {name}, repeat {r + 1}/{repeats}")
            if name == "ours":
                done[name] = converse(ours_server(path), body, ours=True)
            else:
                done[name] = converse(llama_server_at_defaults(llama_server, path), body, ours=False)
            _log_conversation(log, name, done[name])
        runs.append(Repeat(done["ours"], done["llama-server"], ours_first))
    return _figures(runs, shape)


def agent_request(tools: Sequence[str] | None) -> Body:
    """The recorded request, streamed, greedy and short; with `tools`, only those tools, as `claude --tools` sends."""
    body = json.loads(REQUEST.read_text())
    # "bench": served_model's name for the model; llama-server serves the one model it has under any name
    body.update(model="bench", stream=True, temperature=0, max_tokens=ANSWER_TOKENS)
    if tools:
        unknown = set(tools) - {tool["name"] for tool in body["tools"]}
        if unknown:
            raise ValueError(f"--agent-tools: the request has no tool {', '.join(sorted(unknown))}")
        body["tools"] = [tool for tool in body["tools"] if tool["name"] in tools]
        if "Agent" not in tools:  # the agent types are the Agent tool's: Claude Code sends them only with it
            body["messages"] = [m for m in body["messages"] if not _agent_types(m)]
    return body


def _agent_types(message: Body) -> bool:
    content = message["content"]
    return message["role"] == "system" and isinstance(content, str) and content.startswith("Available agent types")


def follow_up(body: Body, answer: list[dict[str, Any]]) -> Body:
    """Turn 2: turn 1's messages, the answer as it came, a result for each tool it called and a short question.
    The cache mark moves to the new message, as Claude Code moves it."""
    messages = copy.deepcopy(body["messages"])
    for message in messages:
        if isinstance(message["content"], list):
            for block in message["content"]:
                block.pop("cache_control", None)
    results = [
        {"type": "tool_result", "tool_use_id": block["id"], "content": "(not run: a benchmark)"}
        for block in answer
        if block["type"] == "tool_use"
    ]
    question = {"type": "text", "text": FOLLOW_UP, "cache_control": {"type": "ephemeral"}}
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": [*results, question]}]
    return {**body, "messages": messages}


def converse(served: AbstractContextManager[str], body: Body, *, ours: bool) -> Conversation:
    """Both turns on one fresh server, after a warm-up that shares no prefix with them."""
    with served as base:
        context = _context(base, ours)
        _warm_up(base, ours)
        counted = count_tokens(base, body)
        first = stream_turn(base, body)
        second = stream_turn(base, follow_up(body, first.content()))
    return Conversation(first, second, counted, context)


# ---------------------------------------------------------------------------------------------------------- servers


@contextmanager
def ours_server(path: Path) -> Iterator[str]:
    """`localllm serve` at its defaults on a private home of its own: no prefix cache from an earlier repeat."""
    with rest.served_model(path, slots=None, threads=None, n_ctx=None) as base:
        yield base


@contextmanager
def llama_server_at_defaults(binary: str, path: Path) -> Iterator[str]:
    """`llama-server -m MODEL` as a user starts it (its own context, slots, threads and --jinja default); the process
    is ended however the block ends, a failed start included."""
    port = rest.free_port()
    cmd = [binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _wait_healthy(base: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"llama-server did not answer /health within {START_TIMEOUT:.0f} s")


def _context(base: str, ours: bool) -> int | None:
    """The context the server loaded: ours from /api/ps, llama-server's from /props."""
    client = rest.http_client()
    if ours:
        rows = client.get(f"{base}/api/ps", timeout=30).json().get("models") or [{}]
        return rows[0].get("context_length")
    props = client.get(f"{base}/props", timeout=30).json()
    return (props.get("default_generation_settings") or {}).get("n_ctx")


def _warm_up(base: str, ours: bool) -> None:
    client = rest.http_client()
    if ours:
        body = {"model": "bench", "prompt": WARM_UP, "raw": True, "stream": False, "options": {"num_predict": 4}}
        client.post(f"{base}/api/generate", json=body, timeout=600).raise_for_status()
    else:
        body = {"prompt": WARM_UP, "n_predict": 4, "cache_prompt": True}
        client.post(f"{base}/completion", json=body, timeout=600).raise_for_status()


def count_tokens(base: str, body: Body) -> int | None:
    """The request's prompt tokens by the server's /v1/messages/count_tokens (None where it cannot say)."""
    counted = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "temperature")}
    reply = rest.http_client().post(f"{base}/v1/messages/count_tokens", json=counted, timeout=600)
    return reply.json().get("input_tokens") if reply.status_code == 200 else None


# ---------------------------------------------------------------------------------------------------------- a turn


def stream_turn(base: str, body: Body, timeout: float = TURN_TIMEOUT) -> Turn:
    """One streamed /v1/messages request, read to its end within `timeout` seconds in all."""
    turn = Turn(time.perf_counter())
    deadline = time.monotonic() + timeout
    with rest.http_client().stream("POST", f"{base}/v1/messages", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{base}/v1/messages answered {resp.status_code}: {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base}/v1/messages: the turn did not end within {timeout:.0f} s")
            if not line.startswith(("event:", "data:")):
                continue  # a blank line between events, or an SSE comment (a keep-alive, not an event)
            if math.isnan(turn.first_event):
                turn.first_event = time.perf_counter()
            if line.startswith("data:"):
                _take(turn, json.loads(line[len("data:") :]))
    if math.isnan(turn.first_token):
        raise RuntimeError(f"{base}/v1/messages streamed no content")
    return turn


def _take(turn: Turn, event: dict[str, Any]) -> None:
    kind = event.get("type")
    if kind == "error":
        raise RuntimeError(f"the stream ended in an error: {event.get('error')}")
    if kind == "message_start":
        turn.usage.update(event["message"].get("usage") or {})
    elif kind == "message_delta":
        turn.usage.update(event.get("usage") or {})  # ours repeats the whole split; llama-server only output_tokens
    elif kind == "content_block_start":
        block = dict(event["content_block"])
        turn.blocks[event["index"]] = block
        if block["type"] == "tool_use":
            _first_token(turn)
    elif kind == "content_block_delta":
        _first_token(turn)
        _apply_delta(turn, event["index"], event["delta"])


def _first_token(turn: Turn) -> None:
    if math.isnan(turn.first_token):
        turn.first_token = time.perf_counter()


def _apply_delta(turn: Turn, index: int, delta: dict[str, Any]) -> None:
    block = turn.blocks.setdefault(index, {"type": "text", "text": ""})
    if delta["type"] == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
    elif delta["type"] == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta["thinking"]
    elif delta["type"] == "signature_delta":
        block["signature"] = delta["signature"]
    elif delta["type"] == "input_json_delta":
        turn.partial_json[index] = turn.partial_json.get(index, "") + delta["partial_json"]


def _parsed(text: str, fallback: Any) -> Any:
    """A tool call's streamed input; a call cut off by max_tokens goes back with the input it was opened with."""
    try:
        return json.loads(text) if text else (fallback or {})
    except json.JSONDecodeError:
        return fallback or {}


def _log_conversation(log: Callable[[str], None], name: str, run: Conversation) -> None:
    for label, turn in (("turn 1", run.first), ("turn 2", run.second)):
        log(
            f"agents: {name} {label}: first event {turn.ttfe():.2f} s, first token {turn.ttft():.2f} s, "
            f"prompt {turn.prompt()} tokens, {turn.reused()} reused"
        )
    # what turn 2 carries back decides how much of turn 1's answer it can reuse
    blocks = [block["type"] for block in run.first.content()]
    log(f"agents: {name} turn 1 answered {', '.join(blocks) or 'nothing'}: {json.dumps(run.first.content())[:300]}")


# ---------------------------------------------------------------------------------------------------------- figures

TURNS: tuple[tuple[str, Callable[[Conversation], Turn]], ...] = (
    ("turn 1 (cold)", lambda run: run.first),
    ("turn 2", lambda run: run.second),
)


def _figures(runs: list[Repeat], shape: str) -> list[Figure]:
    ours, theirs = [r.ours for r in runs], [r.theirs for r in runs]
    counted = ours[0].counted
    size = f"prompt {counted} tokens by our count_tokens (llama-server's {theirs[0].counted}), {shape}"
    setting = (
        f"both at their defaults (context: ours {ours[0].context}, llama-server {theirs[0].context}), "
        f"each fresh per repeat, the first alternating; streamed /v1/messages, greedy, {ANSWER_TOKENS} tokens at most"
    )
    figures = []
    for label, pick in TURNS:
        figures.append(
            _time_figure(
                f"agent {label}: time to first token", runs, pick, Turn.ttft, TTFT_TARGET, f"{size}; {setting}"
            )
        )
    figures.append(_reuse_figure(runs))
    for label, pick in TURNS:
        figures.append(
            _time_figure(
                f"agent {label}: time to first event",
                runs,
                pick,
                Turn.ttfe,
                None,
                "any SSE event: ours sends message_start before the prefill, llama-server with the first token",
            )
        )
    return figures


def _time_figure(
    name: str,
    runs: list[Repeat],
    pick: Callable[[Conversation], Turn],
    measure: Callable[[Turn], float],
    target: float | None,
    note: str,
) -> Figure:
    ours = [measure(pick(r.ours)) for r in runs]
    theirs = [measure(pick(r.theirs)) for r in runs]
    each = ", ".join(
        f"{o / t:.2f} ({'ours' if r.ours_first else 'llama-server'} first)"
        for o, t, r in zip(ours, theirs, runs, strict=True)
    )
    return Figure(
        name,
        statistics.median(ours),
        statistics.median(theirs),
        "s",
        target,
        lower_is_better=True,
        note=f"{note}; median of {len(runs)} repeats, each repeat's ratio: {each}",
    )


def _reuse_figure(runs: list[Repeat]) -> Figure:
    """Turn 2's prompt tokens each server reported as reused: informational, the two count their own prompts."""
    ours = [r.ours.second for r in runs]
    theirs = [r.theirs.second for r in runs]
    share = ", ".join(
        f"ours {o.reused()}/{o.prompt()}, llama-server {t.reused()}/{t.prompt()}"
        for o, t in zip(ours, theirs, strict=True)
    )
    return Figure(
        "agent turn 2: prompt tokens reused",
        statistics.median(o.reused() for o in ours),
        statistics.median(t.reused() for t in theirs),
        "tok",
        None,
        note=f"cache_read_input_tokens of turn 2's prompt, each repeat: {share}",
    )
