"""The coding agents as their registries ship them (scripts/install_agents.sh puts them in a cache outside the tree;
LOCALLLM_AGENTS_BIN names another folder), started through `localllm launch` against the real server on loopback,
in their non-interactive modes, with HOME a temp folder so that no user's config is read or changed.

Between each agent and the server sits a recording proxy: it keeps every request and response, and when a
generation's response headers arrive it reads the server's /api/ps, so a test can show that the stream opened while
the prompt was still prefilling (the slot holds fewer tokens than the prompt), without asserting a time. The usage
each route reports (cached prompt tokens included) shows how much of a turn's prompt the next turn reused.

The model is qwen2.5-coder:0.5b made greedy (temperature 0), so that it follows a short tool instruction alike on
every run. The agents are kept off every host but loopback: their telemetry and update checks are off, and a proxy
that refuses all is named for anything else, so nothing waits on a network that is not there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import CODER_TEST_MODEL, PAIR_TARGET_MODEL
from server_harness import local_client, private_home, serve_in_thread, served

pytestmark = [pytest.mark.models, pytest.mark.slow]

MODEL = "agent-coder"  # qwen2.5-coder:0.5b at temperature 0
# qwen2.5-coder:1.5b at temperature 0, for the agents whose prompt the 0.5B does not follow to a well-formed tool call
FOLLOWER = "agent-coder-1.5b"
CONTEXT = 32_768  # the trained context: Claude Code's full first request (the replay) fits
AGENT_BIN = Path(os.environ.get("LOCALLLM_AGENTS_BIN", Path.home() / ".cache" / "localllm-agents" / "bin"))
# The routes the agents generate on (launch's own load, a POST /api/generate, is not one of them).
GENERATION_ROUTES = ("/v1/messages", "/v1/chat/completions", "/v1/responses", "/api/chat")
AGENT_SECONDS = 420  # one agent's whole run on a busy 2-core machine; a hang fails instead of blocking the suite
REFUSING_PROXY = "http://127.0.0.1:9"  # a closed loopback port: any host but loopback fails at once
REFUSED = {
    "HTTP_PROXY": REFUSING_PROXY,
    "HTTPS_PROXY": REFUSING_PROXY,
    "ALL_PROXY": REFUSING_PROXY,
    "http_proxy": REFUSING_PROXY,
    "https_proxy": REFUSING_PROXY,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
OFFLINE = {
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "AIDER_CHECK_UPDATE": "false",
    "AIDER_ANALYTICS": "false",
    "NO_COLOR": "1",
}


# Qwen Code's own switches for what it would send elsewhere (its settings.json).
QWEN_OFFLINE = {"telemetry": {"enabled": False}, "privacy": {"usageStatisticsEnabled": False}}
# The tools Qwen Code offers beside --core-tools (which limits only its file and shell tools), and those it reveals
# once tool_search is gone: excluded, its prompt holds read_file and run_shell_command alone (as Claude Code's --tools).
QWEN_EXTRA_TOOLS = ["agent", "skill", "tool_search", "task_stop", "send_message", "ask_user_question", "exit_plan_mode"]

# ---------------------------------------------------------------------------------------------------------- proxy


@dataclass
class Exchange:
    """One request through the proxy: what the agent sent, the server's status, /api/ps when the headers came, and
    the response's bytes."""

    method: str
    path: str
    body: dict
    status: int = 0
    ps_at_headers: dict | None = None
    response: bytearray = field(default_factory=bytearray)

    @property
    def generation(self) -> bool:
        return self.method == "POST" and self.path in GENERATION_ROUTES

    def events(self) -> list[dict]:
        """The response's JSON values: SSE `data:` lines, or NDJSON lines."""
        found = []
        for line in bytes(self.response).decode(errors="replace").splitlines():
            text = line.removeprefix("data:").strip()
            if text.startswith("{"):
                found.append(json.loads(text))
        return found

    def usage(self) -> tuple[int, int]:
        """(prompt tokens, of them reused from the cache), as the route reports them."""
        prompt = cached = 0
        for event in self.events():
            if self.path == "/v1/messages" and "usage" in (event.get("message") or event):
                usage = (event.get("message") or event)["usage"]
                cached = usage.get("cache_read_input_tokens", 0)
                prompt = usage["input_tokens"] + cached
            elif self.path == "/v1/responses" and (event.get("response") or {}).get("usage"):
                usage = event["response"]["usage"]
                prompt, cached = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
            elif self.path == "/v1/chat/completions" and event.get("usage"):
                usage = event["usage"]
                prompt = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            elif self.path.startswith("/api/") and event.get("done"):
                prompt, cached = event.get("prompt_eval_count", 0), event.get("prompt_cache_count", 0)
        return prompt, cached


class Recorder:
    """A loopback proxy to the server that keeps every exchange."""

    def __init__(self, target: str):
        self.target = target
        self.url = ""  # the proxy's own, once it serves
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()

    def app(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        hop = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}

        async def forward(request: Request):
            raw = await request.body()
            exchange = Exchange(request.method, request.url.path, _json_or_empty(raw))
            with self._lock:
                self.exchanges.append(exchange)
            client = httpx.AsyncClient(timeout=None)
            url = self.target + request.url.path + (f"?{request.url.query}" if request.url.query else "")
            headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
            asked = client.build_request(request.method, url, headers=headers, content=raw)
            upstream = await client.send(asked, stream=True)
            exchange.status = upstream.status_code
            if exchange.generation:
                exchange.ps_at_headers = (await client.get(self.target + "/api/ps")).json()

            async def relay():
                try:
                    async for piece in upstream.aiter_raw():
                        exchange.response += piece
                        yield piece
                finally:
                    await upstream.aclose()
                    await client.aclose()

            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in hop}
            return StreamingResponse(relay(), status_code=upstream.status_code, headers=kept)

        methods = ["GET", "POST", "PUT", "DELETE", "HEAD"]
        return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])

    def generations(self) -> list[Exchange]:
        with self._lock:
            return [exchange for exchange in self.exchanges if exchange.generation]


def _json_or_empty(raw: bytes) -> dict:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(pair_home, tmp_path_factory) -> Iterator[str]:
    """The real server on a private home holding MODEL and FOLLOWER."""
    from localllm import api

    home = private_home(pair_home, tmp_path_factory.mktemp("agents"))
    client = local_client(home)
    for name, source in ((MODEL, CODER_TEST_MODEL), (FOLLOWER, PAIR_TARGET_MODEL)):
        create = {"model": name, "from": source, "parameters": {"temperature": 0}}
        for _ in client.create(api.CreateRequest.model_validate(create)):
            pass
    client.close()
    with served(home, LOCALLLM_NUM_PARALLEL="1") as url:
        yield url


@pytest.fixture
def recorder(server) -> Iterator[Recorder]:
    recording = Recorder(server)
    with serve_in_thread(recording.app()) as proxy_url:
        recording.url = proxy_url
        yield recording


def installed(command: str) -> Path:
    path = AGENT_BIN / command
    if not path.exists() and shutil.which(command) is None:
        pytest.skip(f"{command} is not installed: bash scripts/install_agents.sh")
    return AGENT_BIN if path.exists() else Path(shutil.which(command) or "").parent


def run_agent(
    tool: str,
    args: list[str],
    *,
    recorder: Recorder,
    home: Path,
    cwd: Path,
    model: str = MODEL,
    extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`localllm launch TOOL --model MODEL -- ARGS` with HOME=cwd's sibling, through the recording proxy. `home` is
    the LOCALLLM_HOME the in-process server reports (the test's own), which launch checks it is talking to."""
    command = {"continue": "cn"}.get(tool, tool)
    folder = installed(command)
    user = cwd.parent / "user"
    user.mkdir(exist_ok=True)
    env = {
        "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(user),
        "LOCALLLM_HOME": str(home),
        "LOCALLLM_HOST": recorder.url.removeprefix("http://"),
        "LOCALLLM_REGISTRY": REFUSING_PROXY,
        "LANG": "C.UTF-8",
        **OFFLINE,
        # Qwen Code sends even loopback requests through a named proxy (NO_PROXY is not read): its telemetry is off
        # in its settings instead (qwen_settings).
        **({} if tool == "qwen" else REFUSED),
        **(extra or {}),
    }
    launch = [sys.executable, "-m", "localllm", "launch", tool, "--model", model, "--context", str(CONTEXT)]
    return subprocess.run(
        [*launch, "--", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=AGENT_SECONDS,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def workdir(tmp_path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


# ---------------------------------------------------------------------------------------------------------- checks


def assert_opened_during_prefill(first: Exchange) -> None:
    """The first request was accepted, and its headers came while the slot held less than its prompt."""
    assert first.status == 200, bytes(first.response)[:500]
    prompt, cached = first.usage()
    assert prompt > 0, first.events()[-3:]
    assert first.ps_at_headers is not None
    row = ps_row(first.ps_at_headers, first.body["model"])
    assert row["slots_busy"] == 1 and row["kv_used"] < prompt, (row["kv_used"], prompt, cached)


def ps_row(ps: dict, model: str) -> dict:
    (row,) = [row for row in ps["models"] if row["name"].removesuffix(":latest") == model]
    return row


def assert_second_turn_reuses(first: Exchange, second: Exchange) -> None:
    prompt, _ = first.usage()
    _, reused = second.usage()
    assert second.status == 200 and reused >= 0.9 * prompt, (reused, prompt)


def tool_turns(recorder: Recorder) -> list[Exchange]:
    """The agent's own turns: the generations that offer tools (not its title or summary requests)."""
    return [exchange for exchange in recorder.generations() if exchange.body.get("tools")]


def written(exchange: Exchange) -> str:
    """What the model wrote in a streamed answer (its text and any call), to show when it made no call."""
    return bytes(exchange.response).decode(errors="replace")[-3000:]


def ran_by_agent(exchange: Exchange, marker: str) -> bool:
    """Whether the request carries the result of a tool call that names `marker` (the agent ran the call)."""
    text = json.dumps(exchange.body)
    return marker in text and ("tool_result" in text or '"role": "tool"' in text or "function_call_output" in text)


# ---------------------------------------------------------------------------------------------------------- agents


def test_claude_code_runs_a_tool_the_model_calls(recorder, workdir, isolated_home):
    home = isolated_home
    prompt = "Use the Bash tool to run `mkdir made-by-claude`."
    args = ["-p", prompt, "--tools", "Read,Write,Bash", "--allowedTools", "Bash", "--max-turns", "2"]
    done = run_agent("claude", args, recorder=recorder, home=home, cwd=workdir, model=FOLLOWER)
    turns = tool_turns(recorder)
    assert len(turns) >= 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert_opened_during_prefill(turns[0])
    assert (workdir / "made-by-claude").is_dir()  # the model's tool_use reached Claude Code, which ran it
    assert ran_by_agent(turns[1], "made-by-claude")
    assert_second_turn_reuses(turns[0], turns[1])


# Codex's prompt as small as its switches make it: no goal tools, no skills list, no question tool.
CODEX_SMALL = [
    "--disable",
    "goals",
    "-c",
    "skills.include_instructions=false",
    "-c",
    "tools.experimental_request_user_input.enabled=false",
]


def test_codex_runs_a_tool_the_model_calls_and_codex_oss_starts(recorder, workdir, isolated_home):
    """`codex exec`: the model's shell call reaches Codex, which runs it, and the next request (carrying the call's
    output) reuses the first one's prompt. Then `codex --oss`, Codex's own Ollama provider, starts and answers."""
    home = isolated_home
    quiet = ["exec", "--skip-git-repo-check", "-c", "check_for_update_on_startup=false", *CODEX_SMALL]
    # Codex's sandbox needs kernel features a CI container may not grant; exec never asks for approval
    unsandboxed = [*quiet, "--dangerously-bypass-approvals-and-sandbox"]
    # The 0.5B copies `justification`'s description into its call, which Codex refuses, and then repeats the call.
    # Codex sets no output limit: without "then say done" the 1.5B's answer to the call's output does not end.
    prompt = "Call exec_command with cmd `mkdir made-by-codex`, then say done."
    done = run_agent("codex", [*unsandboxed, prompt], recorder=recorder, home=home, cwd=workdir, model=FOLLOWER)
    turns = recorder.generations()
    assert len(turns) >= 2 and turns[0].path == "/v1/responses", (done.stdout[-2000:], done.stderr[-2000:])
    assert_opened_during_prefill(turns[0])
    assert (workdir / "made-by-codex").is_dir(), written(turns[0])  # the model's function_call reached Codex
    assert ran_by_agent(turns[1], "made-by-codex")
    assert_second_turn_reuses(turns[0], turns[1])
    assert done.returncode == 0, done.stderr[-2000:]

    # --oss: Codex's own Ollama provider checks /api/version and the model list, then asks /v1/responses.
    oss = {"CODEX_OSS_BASE_URL": recorder.url + "/v1"}
    # the name as /api/tags lists it: Codex pulls a model it does not find there
    oss_args = [*quiet, "--oss", "--local-provider", "ollama", "-m", f"{FOLLOWER}:latest", "Say hi."]
    started = run_agent("codex", oss_args, recorder=recorder, home=home, cwd=workdir, extra=oss)
    assert started.returncode == 0, started.stderr[-2000:]
    assert "/api/version" in [exchange.path for exchange in recorder.exchanges]
    assert recorder.generations()[-1].status == 200


# opencode's prompt as small as its config makes it: the tools it denies are not offered, bash and read are.
OPENCODE_DENIED = ("edit", "glob", "grep", "task", "todowrite", "webfetch", "skill")
OPENCODE_SMALL = {"permission": dict.fromkeys(OPENCODE_DENIED, "deny")}


def test_opencode_runs_a_tool_the_model_calls_and_its_next_turn_reuses_the_first(recorder, workdir, isolated_home):
    """`opencode run`: the model's bash call reaches opencode, which runs it, and the next request (carrying the
    call's output) reuses the first one's prompt. The 0.5B does not follow opencode's prompt to a well-formed tool
    call (it names the command as the tool)."""
    (workdir / "opencode.json").write_text(json.dumps(OPENCODE_SMALL))  # its project config, merged with launch's
    prompt = "Use the bash tool to run `mkdir made-by-opencode`."
    args = ["run", "--auto", prompt]  # --auto: what it would ask permission for is allowed, as no one can answer
    done = run_agent("opencode", args, recorder=recorder, home=isolated_home, cwd=workdir, model=FOLLOWER)
    turns = tool_turns(recorder)  # its title requests offer no tools
    assert len(turns) >= 2 and turns[0].path == "/v1/chat/completions", (done.stdout[-2000:], done.stderr[-2000:])
    assert_opened_during_prefill(turns[0])
    assert (workdir / "made-by-opencode").is_dir(), written(turns[0])  # the model's tool call reached opencode
    assert ran_by_agent(turns[1], "made-by-opencode")
    assert_second_turn_reuses(turns[0], turns[1])
    assert done.returncode == 0, done.stderr[-2000:]


def test_qwen_code_runs_a_tool_the_model_calls_and_its_next_turn_reuses_the_first(recorder, workdir, isolated_home):
    """Qwen Code's first request is streamed, the model's shell call reaches Qwen Code, which runs it, and the next
    request (carrying the call's output) reuses the first one's prompt. launch turns off its managed auto-memory,
    whose extraction request after every turn (a prompt of its own, awaited before exit) would double the prefill.
    The 0.5B does not follow its prompt to a well-formed tool call."""
    settings = workdir.parent / "user" / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps(QWEN_OFFLINE))  # launch merges its provider into the user's settings
    small = ["--core-tools", "read_file", "run_shell_command", "--exclude-tools", *QWEN_EXTRA_TOOLS]
    prompt = "Call run_shell_command with command `mkdir made-by-qwen`, then say done."
    done = run_agent(
        "qwen", [prompt, "--yolo", *small], recorder=recorder, home=isolated_home, cwd=workdir, model=FOLLOWER
    )
    turns = tool_turns(recorder)
    assert len(turns) >= 2 and turns[0].path == "/v1/chat/completions", (done.stdout[-2000:], done.stderr[-2000:])
    # one system prompt throughout: no request of auto-memory's own
    assert len({json.dumps(t.body["messages"][0]) for t in turns}) == 1, len(turns)
    assert [t["function"]["name"] for t in turns[0].body["tools"]] == ["read_file", "run_shell_command"]
    assert_opened_during_prefill(turns[0])
    assert (workdir / "made-by-qwen").is_dir(), written(turns[0])  # the model's tool call reached Qwen Code
    assert ran_by_agent(turns[1], "made-by-qwen")
    assert_second_turn_reuses(turns[0], turns[1])
    assert done.returncode == 0, done.stderr[-2000:]


def test_aider_answers_and_its_second_message_reuses_the_first(recorder, workdir, isolated_home):
    """aider calls no tools (its edits are text it applies itself): its first request is streamed, and a second
    message (with the chat history restored) reuses what the two share. aider ends every request with its own
    reminder after the user's message, which the next request does not repeat there: on its short prompt that tail
    is a third of it, so the share is measured on the messages both requests hold."""
    quiet = ["--yes", "--no-git", "--no-check-update", "--no-analytics", "--no-show-model-warnings", "--no-pretty"]
    first_run = run_agent("aider", [*quiet, "--message", "Say hi."], recorder=recorder, home=isolated_home, cwd=workdir)
    assert first_run.returncode == 0, first_run.stdout[-2000:]
    second_run = run_agent(
        "aider",
        [*quiet, "--restore-chat-history", "--message", "Say bye."],
        recorder=recorder,
        home=isolated_home,
        cwd=workdir,
    )
    assert second_run.returncode == 0, second_run.stdout[-2000:]
    first, second = recorder.generations()[-2:]
    assert first.path == second.path == "/api/chat"
    assert_opened_during_prefill(first)
    shared = []
    for mine, theirs in zip(first.body["messages"], second.body["messages"], strict=False):
        if mine != theirs:
            break
        shared.append(mine)
    assert len(shared) > 1
    counted = httpx.post(recorder.url + "/api/count_tokens", json={"model": MODEL, "messages": shared}, timeout=60)
    _, reused = second.usage()
    assert reused >= 0.9 * counted.json()["input_tokens"], (reused, counted.json())


# ---------------------------------------------------------------------------------------------------------- replay

RECORDED = Path(__file__).parent / "data" / "claude_code_first_request.json"


def test_claude_codes_full_first_request_is_accepted_and_opens_at_once(server):
    """Claude Code's whole first request, as its binary sent it (24 tools, a mid-conversation system message, a
    tool with maxLength 524288, adaptive thinking): accepted, and its stream opens before the long prefill ends.
    The client leaves after the opening; the slot comes free."""
    body = {**json.loads(RECORDED.read_text()), "model": MODEL}
    load = {"model": MODEL, "keep_alive": -1, "options": {"num_ctx": CONTEXT}}
    httpx.post(server + "/api/generate", json=load, timeout=300).raise_for_status()
    counted = httpx.post(server + "/v1/messages/count_tokens", json=body, timeout=120)
    assert counted.status_code == 200, counted.text
    tokens = counted.json()["input_tokens"]
    assert tokens > 15_000  # the whole request, not a shortened one
    with httpx.stream("POST", server + "/v1/messages", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
        start = json.loads(next(lines).removeprefix("data: "))
        usage = start["message"]["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == tokens
        row = ps_row(httpx.get(server + "/api/ps").json(), MODEL)
        assert row["slots_busy"] == 1 and row["kv_used"] < tokens
    assert wait_until_idle(server)


def wait_until_idle(url: str, seconds: float = 120) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rows = httpx.get(url + "/api/ps").json()["models"]
        if all(row["slots_busy"] == 0 for row in rows):
            return True
        time.sleep(0.1)
    return False
