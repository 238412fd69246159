"""MCP tools in the TUI through Textual's Pilot, on qwen2.5-coder:0.5b (in-process, greedy) and the edge server's
tools: the confirm dialog, a tool card with the call and its result, the answer using it; a refusal; a hanging tool
cut at its limit; the /prompt and /resource commands."""

from __future__ import annotations

import sys

import pytest
from mcp_servers import EDGE_SERVER
from test_tui import SIZE, notices, type_text, wait_for_answer

from localllm.mcp.config import parse_entry
from localllm.mcp.sessions import McpSessions
from localllm.mcp.tool_loop import Toolbox
from localllm.tui.app import LocalLLMApp
from localllm.tui.screens.tools import ToolConfirmScreen
from localllm.tui.widgets.message_list import MessageList, MessageView
from localllm.tui.widgets.prompt_input import PromptInput

pytestmark = [pytest.mark.anyio, pytest.mark.models]

MODEL = "qwen2.5-coder:0.5b"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
OPTIONS = {"temperature": 0.0, "seed": 1, "num_predict": 60}


@pytest.fixture(scope="module")
def coder_client(coder_home):
    from localllm.client.local import LocalClient
    from localllm.models.store import Store

    client = LocalClient(store=Store(coder_home / "models"))
    yield client
    client.close()


@pytest.fixture
def toolbox(tmp_path):
    servers = {
        "clock": {"command": sys.executable, "args": [str(EDGE_SERVER), "city_time"]},
        "slow": {"command": sys.executable, "args": [str(EDGE_SERVER), "hang"], "timeout": 3},
        "stuck": {"command": sys.executable, "args": [str(EDGE_SERVER), "hang"], "timeout": 600},
    }
    entries = [parse_entry(name, body, tmp_path / "mcp.json") for name, body in servers.items()]
    box = Toolbox(McpSessions(entries, log_dir=tmp_path / "logs"))
    yield box
    box.close()


async def ask(pilot, text: str, decision: str) -> None:
    await type_text(pilot, text)
    await pilot.press("enter")
    for _ in range(2400):
        if isinstance(pilot.app.screen, ToolConfirmScreen):
            break
        await pilot.pause(0.1)
    else:
        raise AssertionError("no confirm dialog came")
    await pilot.press(decision)
    await wait_for_answer(pilot, limit=2400)


def cards(app, role: str) -> list[str]:
    return [view.source for view in app.screen.query_one(MessageList).query(MessageView).filter(f".{role}")]


async def test_a_call_is_confirmed_in_a_dialog_shown_as_a_card_and_used(coder_client, toolbox):
    toolbox.set_enabled("slow", False)
    toolbox.set_enabled("stuck", False)
    app = LocalLLMApp(coder_client, model=MODEL, system=SYSTEM, options=OPTIONS, tools=toolbox)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ask(pilot, "What time is it in Tokyo?", "y")
        [card] = cards(app, "tool")
        assert "clock › city_time" in card and '"Tokyo"' in card
        assert "result:" in card and "The local time in Tokyo is 09:41." in card
        assert "09:41" in cards(app, "assistant")[-1]  # the answer, from the result

        await pilot.press("ctrl+l")
        await ask(pilot, "What time is it in Tokyo?", "n")
        [card] = cards(app, "tool")
        assert "declined" in card and "The user declined to run this tool call" in card
        assert app.conversation.messages[2].role == "tool"  # and the model was told so
        assert "declined" in app.conversation.messages[2].content


async def test_a_hanging_tool_is_cut_at_its_limit(coder_client, toolbox):
    toolbox.set_enabled("clock", False)
    toolbox.set_enabled("stuck", False)
    app = LocalLLMApp(coder_client, model=MODEL, system=SYSTEM, options=OPTIONS, tools=toolbox)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ask(pilot, "What time is it in Tokyo? Use the hang tool.", "y")
        [card] = cards(app, "tool")
        assert "slow › hang" in card and "tool error" in card and "ran past its time limit of 3 s" in card


async def test_escape_stops_a_running_tool_and_the_chat_goes_on(coder_client, toolbox):
    toolbox.set_enabled("clock", False)
    toolbox.set_enabled("slow", False)
    app = LocalLLMApp(coder_client, model=MODEL, system=SYSTEM, options=OPTIONS, tools=toolbox)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await type_text(pilot, "What time is it in Tokyo? Use the hang tool.")
        await pilot.press("enter")
        for _ in range(2400):
            if isinstance(app.screen, ToolConfirmScreen):
                break
            await pilot.pause(0.1)
        await pilot.press("y")
        await pilot.pause(1)  # the call runs (its limit is ten minutes)
        await pilot.press("escape")
        await wait_for_answer(pilot, limit=600)  # a minute at most: the call was cancelled, not waited for
        assert app.conversation.messages[-1].role == "tool"
        assert "stopped this tool call" in app.conversation.messages[-1].content
        assert "(stopped)" in cards(app, "assistant")[-1]


@pytest.fixture
def notes_box(tmp_path):
    """The edge server with its prompt and resource and no tools (the model answers without calling one)."""
    entry = parse_entry("edge", {"command": sys.executable, "args": [str(EDGE_SERVER), "none"]}, tmp_path / "mcp.json")
    box = Toolbox(McpSessions([entry], log_dir=tmp_path / "logs"))
    yield box
    box.close()


async def command(pilot, text: str) -> None:
    """Send a line as if typed (the message box takes it whole) and wait for what it starts."""
    pilot.app.screen.query_one(PromptInput).text = text
    await pilot.press("enter")
    for _ in range(600):
        await pilot.pause(0.1)
        if not pilot.app.screen.workers and not pilot.app.screen._answering:
            return
    raise AssertionError(f"{text} did not finish")


async def test_prompt_and_resource_commands_use_the_servers(coder_client, notes_box):
    app = LocalLLMApp(coder_client, model=MODEL, system=SYSTEM, options=OPTIONS, tools=notes_box)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await command(pilot, "/prompt")
        assert any("edge: /prompt haiku topic" in note for note in notices(app))
        await command(pilot, "/prompt nosuch")
        assert any("no MCP prompt named 'nosuch'" in note for note in notices(app))

        await command(pilot, "/resource note://greeting")
        assert any("Attached note://greeting" in note for note in notices(app))
        await command(pilot, "What is the password of the day? Answer with the password only.")
        question = app.conversation.messages[0].content
        assert question.startswith("Resource note://greeting:\n```\nThe password of the day is swordfish.\n```")
        assert "attached note://greeting" in cards(app, "user")[0]
        assert "swordfish" in app.conversation.messages[1].content.lower()

        await pilot.press("ctrl+l")
        await command(pilot, "/prompt haiku rain")
        assert app.conversation.messages[0].content == "Write a haiku about rain."  # nothing attached any more
        assert app.conversation.messages[1].role == "assistant" and app.conversation.messages[1].content
