"""MCP configuration and servers, with no model: mcp.json read and written, `localllm mcp list|add|remove|test` on
real servers (PyPI's time and git servers, npm's filesystem and everything servers over stdio and streamable HTTP),
and the edge server's failing, hanging, crashing and 10 MB tools through the tool loop's call path."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
from mcp_servers import edge_entry, npm_server, time_entry, venv_script
from typer.testing import CliRunner

from localllm.cli import app
from localllm.errors import InvalidInput
from localllm.mcp.config import ServerEntry, load_config, parse_entry
from localllm.mcp.sessions import McpSessions
from localllm.mcp.tool_loop import PendingCall, Toolbox, bound_text, run_call

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def write_config(path: Path, servers: dict) -> Path:
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


# ---------------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({}, "exactly one of command"),
        ({"command": "x", "url": "http://h/mcp"}, "exactly one of command"),
        ({"command": "x", "args": "a b"}, "args must be a list"),
        ({"command": "x", "env": {"KEY": 1}}, "env must map"),
        ({"url": "ftp://h"}, "url must be an http"),
        ({"command": "x", "timeout": 0}, "timeout must be"),
        ({"command": "x", "trust": "yes"}, "trust must be"),
    ],
)
def test_a_bad_entry_names_the_server_and_the_key(tmp_path, body, names):
    with pytest.raises(InvalidInput) as caught:
        load_config(write_config(tmp_path / "mcp.json", {"srv": body}))
    assert "'srv'" in str(caught.value) and names in str(caught.value)


def test_a_bad_env_value_is_never_repeated(tmp_path):
    with pytest.raises(InvalidInput) as caught:
        parse_entry("srv", {"command": "x", "env": {"TOKEN": ["sekrit-value"]}}, tmp_path / "mcp.json")
    assert "sekrit-value" not in str(caught.value)


def test_a_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text("{not json")
    with pytest.raises(InvalidInput, match="mcp.json cannot be read as JSON"):
        load_config(path)


def test_add_and_remove_keep_what_other_clients_wrote(tmp_path):
    path = write_config(tmp_path / "mcp.json", {"other": {"command": "x", "alwaysAllow": ["t"]}})
    json_text = json.loads(path.read_text())
    json_text["globalShortcut"] = "Ctrl+Space"
    path.write_text(json.dumps(json_text))
    assert invoke("mcp", "add", "time", "--config", str(path), "--", "mcp-server-time", "--local-timezone", "UTC")
    assert invoke("mcp", "remove", "time", "--config", str(path)).exit_code == 0
    kept = json.loads(path.read_text())
    assert kept == {"mcpServers": {"other": {"command": "x", "alwaysAllow": ["t"]}}, "globalShortcut": "Ctrl+Space"}


def test_the_cli_lists_servers_without_their_secrets(isolated_home):
    added = invoke("mcp", "add", "edge", "--env", "API_TOKEN=sekrit-1", "--trust", "--", "python3", "edge.py")
    assert added.exit_code == 0, added.output
    remote = invoke("mcp", "add", "docs", "--url", "http://127.0.0.1:9/mcp", "-H", "Authorization=Bearer sekrit-2")
    assert remote.exit_code == 0
    assert (isolated_home / "mcp.json").exists()  # LOCALLLM_HOME's file by default
    listed = invoke("mcp", "list")
    as_json = invoke("mcp", "list", "--json")
    for output in (listed.output, as_json.output):
        assert "sekrit" not in output
    assert "edge" in listed.output and "python3 edge.py" in listed.output and "API_TOKEN" in listed.output
    rows = {row["name"]: row for row in json.loads(as_json.output)}
    assert rows["edge"]["env"] == ["API_TOKEN"] and rows["edge"]["trust"] is True
    assert rows["docs"]["transport"] == "http" and rows["docs"]["headers"] == ["Authorization"]


def test_the_config_file_can_come_from_the_setting(tmp_path, monkeypatch):
    path = write_config(tmp_path / "elsewhere.json", {"time": time_entry()})
    monkeypatch.setenv("LOCALLLM_MCP_CONFIG", str(path))
    assert "time" in invoke("mcp", "list").output


def test_a_server_named_twice_or_not_at_all_is_a_clear_error(isolated_home):
    assert invoke("mcp", "add", "t", "--", "x").exit_code == 0
    again = invoke("mcp", "add", "t", "--", "y")
    assert again.exit_code == 1 and "already in" in again.output
    missing = invoke("mcp", "remove", "nope")
    assert missing.exit_code == 1 and "no MCP server named 'nope'" in missing.output
    neither = invoke("mcp", "add", "u")
    assert neither.exit_code == 1 and "needs a command or --url" in neither.output


# ---------------------------------------------------------------------------------------------------------- mcp test


def _test_lists(path: Path, name: str) -> list[str]:
    result = invoke("mcp", "test", name, "--config", str(path), "--json")
    assert result.exit_code == 0, result.output
    return [tool["name"] for tool in json.loads(result.output)]


def test_mcp_test_lists_the_time_servers_tools(tmp_path):
    path = write_config(tmp_path / "mcp.json", {"time": time_entry()})
    shown = invoke("mcp", "test", "time", "--config", str(path))
    assert shown.exit_code == 0 and "started and lists 2 tool(s)" in shown.output
    assert {"get_current_time", "convert_time"} <= set(_test_lists(path, "time"))


def test_mcp_test_lists_the_git_servers_tools(tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    path = write_config(
        tmp_path / "mcp.json", {"git": {"command": venv_script("mcp-server-git"), "args": ["--repository", str(repo)]}}
    )
    assert {"git_status", "git_log"} <= set(_test_lists(path, "git"))


@pytest.mark.slow  # installs the npm servers on a machine's first run
def test_mcp_test_lists_the_npm_filesystem_servers_tools(tmp_path):
    script = npm_server("@modelcontextprotocol/server-filesystem")
    path = write_config(tmp_path / "mcp.json", {"fs": {"command": "node", "args": [str(script), str(tmp_path)]}})
    assert {"read_text_file", "list_directory"} <= set(_test_lists(path, "fs"))


@pytest.mark.slow  # installs the npm servers on a machine's first run
def test_mcp_test_lists_the_npm_everything_servers_tools(tmp_path):
    script = npm_server("@modelcontextprotocol/server-everything")
    path = write_config(tmp_path / "mcp.json", {"everything": {"command": "node", "args": [str(script)]}})
    assert "echo" in _test_lists(path, "everything")


@pytest.mark.slow  # installs the npm servers on a machine's first run
def test_a_remote_server_is_reached_over_streamable_http(tmp_path):
    script = npm_server("@modelcontextprotocol/server-everything")
    port = _free_port()
    server = subprocess.Popen(
        ["node", str(script), "streamableHttp"],
        env={"PORT": str(port), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port)
        url = f"http://127.0.0.1:{port}/mcp"
        path = write_config(tmp_path / "mcp.json", {"remote": {"url": url, "headers": {"X-Test": "1"}}})
        assert "echo" in _test_lists(path, "remote")
    finally:
        server.terminate()
        server.wait(10)


def test_a_server_that_cannot_start_is_one_line(tmp_path):
    path = write_config(tmp_path / "mcp.json", {"nothing": {"command": str(tmp_path / "no-such-server")}})
    result = invoke("mcp", "test", "nothing", "--config", str(path))
    assert result.exit_code == 1
    assert "MCP server 'nothing' could not start" in result.output and "Traceback" not in result.output


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_port(port: int) -> None:
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


# ---------------------------------------------------------------------------------------------------------- edge cases


@pytest.fixture
def edge(request, tmp_path):
    """The edge server with a short time limit per call (a test may mark another: `@pytest.mark.parametrize(
    "edge", [60], indirect=True)`), and a file it marks each start in."""
    marker = tmp_path / "starts"
    timeout = getattr(request, "param", 2)
    entry = parse_entry("edge", edge_entry(timeout=timeout, env={"EDGE_MARKER": str(marker)}), tmp_path / "mcp.json")
    toolbox = Toolbox(McpSessions([entry], log_dir=tmp_path / "logs"))
    yield toolbox, marker
    toolbox.close()


def _call(toolbox: Toolbox, tool: str, **arguments):
    return run_call(toolbox, PendingCall("edge", tool, arguments, tool))


def test_a_failing_tool_is_an_error_for_the_model(edge):
    toolbox, _ = edge
    outcome = _call(toolbox, "fail", reason="disk on fire")
    assert outcome.status == "error" and outcome.text.startswith("Error:")
    assert _call(toolbox, "echo", text="still here").text == "still here"


def test_a_hanging_tool_is_cut_at_its_limit_and_the_server_goes_on(edge):
    toolbox, marker = edge
    outcome = _call(toolbox, "hang", city="Tokyo")
    assert outcome.status == "error" and "ran past its time limit of 2 s" in outcome.text
    assert _call(toolbox, "echo", text="after").text == "after"
    assert marker.read_text().count("started") == 1  # the same server answered


def test_a_crashing_server_is_an_error_and_starts_again(edge):
    toolbox, marker = edge
    outcome = _call(toolbox, "crash")
    assert outcome.status == "error" and "the server stopped" in outcome.text
    assert _call(toolbox, "echo", text="back").text == "back"
    assert marker.read_text().count("started") == 2


@pytest.mark.slow
@pytest.mark.parametrize("edge", [120], indirect=True)  # 10 MB through a pipe on a busy machine
def test_a_10_mb_result_is_cut_and_the_cut_is_said(edge):
    toolbox, _ = edge
    outcome = _call(toolbox, "big")
    assert outcome.status == "ok" and outcome.truncated
    assert len(outcome.text) < 21_000 and "[truncated: the tool returned 10,485,760 characters" in outcome.text


def test_trust_skips_the_question_per_server_per_tool_or_for_all(tmp_path):
    entries = [
        parse_entry("asks", edge_entry(), tmp_path / "mcp.json"),
        parse_entry("trusted", edge_entry(trust=True), tmp_path / "mcp.json"),
    ]
    toolbox = Toolbox(McpSessions(entries))
    try:
        asks, trusted = PendingCall("asks", "echo", {}, "echo"), PendingCall("trusted", "echo", {}, "echo")
        assert toolbox.needs_confirmation(asks) and not toolbox.needs_confirmation(trusted)
        toolbox.always(asks)
        assert not toolbox.needs_confirmation(asks)
        assert toolbox.needs_confirmation(PendingCall("asks", "fail", {}, "fail"))  # always is for one tool
        toolbox.trust_all = True  # --trust-tools
        assert not toolbox.needs_confirmation(PendingCall("asks", "fail", {}, "fail"))
    finally:
        toolbox.close()


def test_bound_text_keeps_a_short_result_whole():
    assert bound_text("abc", 3) == ("abc", False)
    assert bound_text("abcd", 3)[0].startswith("abc\n[truncated: the tool returned 4 characters; the first 3")


def test_tools_of_two_servers_with_one_name_are_told_apart(tmp_path):
    entries = [parse_entry(name, edge_entry(), tmp_path / "mcp.json") for name in ("a", "b")]
    toolbox = Toolbox(McpSessions(entries))
    try:
        names = set(toolbox.offered(lambda note: None))
        assert {"a__echo", "b__echo"} <= names and "echo" not in names
        toolbox.set_enabled("b", False)
        assert "echo" in toolbox.offered(lambda note: None)
    finally:
        toolbox.close()


def test_a_server_that_fails_to_start_is_left_out_with_a_note(tmp_path):
    broken = ServerEntry("broken", command=str(tmp_path / "missing"))
    toolbox = Toolbox(McpSessions([broken, parse_entry("edge", edge_entry(), tmp_path / "mcp.json")]))
    notes: list[str] = []
    try:
        assert "echo" in toolbox.offered(notes.append)
        assert len(notes) == 1 and "'broken' is left out" in notes[0]
        toolbox.offered(notes.append)
        assert len(notes) == 1  # said once
    finally:
        toolbox.close()


# ---------------------------------------------------------------------------------------------------------- prompts


def test_prompt_arguments_by_position_or_name():
    from localllm.mcp.prompts import prompt_arguments
    from localllm.mcp.sessions import McpPrompt

    prompt = McpPrompt("s", "review", "", ("code", "style"), ("code",))
    assert prompt_arguments(prompt, ["x = 1"]) == {"code": "x = 1"}
    assert prompt_arguments(prompt, ["style=terse", "code=y"]) == {"style": "terse", "code": "y"}
    with pytest.raises(InvalidInput, match="needs code"):
        prompt_arguments(prompt, ["style=terse"])
    with pytest.raises(InvalidInput, match="takes 2 argument"):
        prompt_arguments(prompt, ["a", "b", "c"])


def test_a_resource_is_attached_in_front_of_the_next_question(edge):
    from localllm.cli.mcp_chat import ChatTools
    from localllm.client.local import LocalClient
    from localllm.conversation import Conversation

    toolbox, _ = edge
    client = LocalClient()
    try:
        tools = ChatTools(client, toolbox)
        assert tools.prompt("haiku rain") == "Write a haiku about rain."
        tools.resource("note://greeting")
        conversation = Conversation("any")
        conversation.ask("What is the password?")
        tools.attach_resources(conversation)
        question = conversation.messages[-1].content
        assert question.startswith("Resource note://greeting:\n```\nThe password of the day is swordfish.\n```")
        assert question.endswith("What is the password?") and tools.attached == []
    finally:
        client.close()


class _Notes:
    """A chat surface that keeps the loop's notes and answer, and refuses any call (none should come)."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.answer = ""

    def text(self, piece: str) -> None:
        self.answer += piece

    def thinking(self, piece: str) -> None:
        pass

    def note(self, text: str) -> None:
        self.notes.append(text)

    def calling(self, call) -> None:
        raise AssertionError(f"a model without tools called {call}")

    def confirm(self, call):
        raise AssertionError(f"a model without tools called {call}")

    def result(self, call, outcome) -> None:
        raise AssertionError(f"a model without tools called {call}")

    def cancelled(self) -> bool:
        return False


@pytest.mark.models
def test_a_model_that_cannot_call_tools_is_told_so_and_still_answers(models_home, edge):
    """smollm2's template shows no tools: the loop says so once, offers none, and the chat goes on."""
    from server_harness import local_client

    from localllm.conversation import Conversation
    from localllm.mcp.tool_loop import ToolLoop

    toolbox, _ = edge
    client = local_client(models_home)
    try:
        loop = ToolLoop(client, toolbox)
        view = _Notes()
        conversation = Conversation(model="smollm2:135m", options={"num_predict": 8, "temperature": 0})
        for question in ("Hi.", "And again?"):
            conversation.ask(question)
            assert loop.answer(conversation, view) is not None
        (note,) = view.notes
        assert note == "smollm2:135m cannot call tools (its template has no tools), so MCP tools are not offered"
        assert view.answer and conversation.messages[-1].role == "assistant"
    finally:
        client.close()
