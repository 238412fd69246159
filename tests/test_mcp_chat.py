"""MCP tools in the terminal chat, driven through a pseudo-terminal (pexpect) on qwen2.5-coder:0.5b, greedy: the call
shown and confirmed and its result in the answer; a refused call and the model told so; a hanging tool cut at its
limit; Ctrl-C stopping a running tool; `/tools` listing and toggling servers. The tools come from
tests/mcp_edge_server.py, whose clock always says 09:41, so the answer can be checked."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from mcp_servers import EDGE_SERVER
from server_harness import linked_home
from test_cli_chat import PROMPT, _child_env, say, spawn_chat

from localllm.cli.mcp_chat import CONFIRM

pytestmark = pytest.mark.models

MODEL = "qwen2.5-coder:0.5b"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def tools_home(coder_home, tmp_path_factory) -> Path:
    home = linked_home(coder_home, tmp_path_factory.mktemp("mcp-chat") / "home")
    servers = {
        "clock": {"command": sys.executable, "args": [str(EDGE_SERVER), "city_time"]},
        "slow": {"command": sys.executable, "args": [str(EDGE_SERVER), "hang"], "timeout": 3},
        "stuck": {"command": sys.executable, "args": [str(EDGE_SERVER), "hang"], "disabled": False},
    }
    (home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    return home


def _chat(home: Path):
    child = spawn_chat(_child_env(home), MODEL, "--in-process")
    child.timeout = 240  # a busy two-core machine; nothing is timed
    say(child, f"/set system {SYSTEM}", "Set system message.")
    for line in ("/set parameter temperature 0", "/set parameter seed 1", "/set parameter num_predict 60"):
        say(child, line)
    return child


def test_a_tool_call_is_shown_confirmed_and_its_result_used(tools_home):
    child = _chat(tools_home)
    say(child, "/tools off slow", "MCP server 'slow' is off for this chat")
    say(child, "/tools off stuck", "MCP server 'stuck' is off for this chat")
    say(child, "/tools", "clock", "(on)", "city_time", "slow", "(off)")

    child.sendline("What time is it in Tokyo?")
    child.expect_exact("tool call")
    child.expect_exact("clock › city_time")
    child.expect_exact('"Tokyo"')
    child.expect_exact(CONFIRM)
    child.sendline("y")
    child.expect_exact("result:")
    child.expect_exact("The local time in Tokyo is 09:41.")
    child.expect_exact("09:41")  # the answer, from the result
    child.expect_exact(PROMPT)

    say(child, "/clear", "Cleared session context")
    child.sendline("What time is it in Tokyo?")
    child.expect_exact("clock › city_time")
    child.expect_exact(CONFIRM)
    child.sendline("n")
    child.expect_exact("declined:")
    child.expect_exact("The user declined to run this tool call")  # what the model reads
    child.expect_exact(PROMPT)
    assert "09:41" not in child.before  # nothing ran, so the model cannot know the time
    child.sendline("/bye")
    child.close()


def test_a_hanging_tool_is_cut_at_its_limit_and_ctrl_c_stops_one(tools_home):
    child = _chat(tools_home)
    say(child, "/tools off clock", "MCP server 'clock' is off for this chat")
    say(child, "/tools off stuck", "MCP server 'stuck' is off for this chat")
    child.sendline("What time is it in Tokyo? Use the hang tool.")
    child.expect_exact("slow › hang")
    child.expect_exact(CONFIRM)
    child.sendline("y")
    child.expect_exact("tool error:")
    child.expect_exact("ran past its time limit of 3 s")
    child.expect_exact(PROMPT)

    say(child, "/clear", "Cleared session context")
    say(child, "/tools off slow", "is off")
    say(child, "/tools on stuck", "is on")
    child.sendline("What time is it in Tokyo? Use the hang tool.")
    child.expect_exact("stuck › hang")
    child.expect_exact(CONFIRM)
    child.sendline("a")  # always: the next call of this tool is not asked about
    time.sleep(1)  # the call is running (it never ends on its own: its limit is a minute)
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    say(child, "/tools", "stuck", "(on)")  # the chat goes on
    child.sendline("/bye")
    child.close()


def test_a_resource_goes_with_the_next_message_and_a_prompt_is_a_command(tools_home):
    child = _chat(tools_home)
    for server in ("clock", "slow"):
        say(child, f"/tools off {server}", "is off")
    say(child, "/resource", "note://greeting")
    say(child, "/resource note://greeting", "Attached note://greeting to the next message")
    say(child, "What is the password of the day? Answer with the word only.", "swordfish")
    say(child, "/prompt", "/prompt haiku topic", "Ask for a haiku about a topic.")
    say(child, "/prompt haiku", "Error:", "/prompt haiku needs topic")
    say(child, "/prompt haiku rain", "Write a haiku about rain.")
    child.sendline("/bye")
    child.close()
