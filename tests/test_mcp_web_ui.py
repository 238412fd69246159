"""MCP tools in the browser page (Debian's chromium through Playwright) against the real server started with MCP on,
on qwen2.5-coder:0.5b (greedy) and the edge server's clock: the call as a card with its arguments and a confirm,
the result on the card and in the answer; a declined call and what the model was told; a resource attached and a
prompt sent from the MCP picker and `/prompt`; Stop while a tool runs cancels it on the MCP server."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp_servers import EDGE_SERVER
from server_harness import private_home, served
from test_web_ui import browser, open_page, send, wait_for_answer, wait_until  # noqa: F401  (browser: a fixture)

pytestmark = pytest.mark.models

MODEL = "qwen2.5-coder:0.5b"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
SETTINGS = {"system": SYSTEM, "temperature": "0", "seed": "1", "num_predict": "60"}


@pytest.fixture(scope="module")
def mcp_url(coder_home, tmp_path_factory) -> Iterator[str]:
    home = private_home(coder_home, tmp_path_factory.mktemp("mcp-web"))
    servers = {"clock": {"command": sys.executable, "args": [str(EDGE_SERVER), "city_time"]}}
    (home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    settings = {"LOCALLLM_MCP": "1", "LOCALLLM_MCP_CONFIG": str(home / "mcp.json"), "LOCALLLM_CONTEXT_LENGTH": "2048"}
    with served(home, **settings) as url:
        yield url


def start_chat(page) -> None:
    """A new chat with SETTINGS (the settings panel stays open from one chat to the next)."""
    page.click("#new-chat")
    page.select_option("#model", MODEL)
    if page.locator("#settings").is_hidden():
        page.click("#settings-toggle")
    for name, value in SETTINGS.items():
        field = page.locator(f"[data-setting={name}]")
        field.fill(value)
        field.dispatch_event("change")


def ask_and_decide(page, decision: str):
    start_chat(page)
    send(page, "What time is it in Tokyo?")
    card = page.locator("#messages article.tool").last
    card.locator(f"button[data-decision={decision}]").click()
    return card, wait_for_answer(page)


def test_a_tool_call_is_a_card_confirmed_then_used(browser, mcp_url):  # noqa: F811
    page = open_page(browser, mcp_url)
    card, answer = ask_and_decide(page, "yes")
    assert card.locator("header").inner_text() == "clock › city_time"
    assert json.loads(card.locator("pre.arguments").inner_text()) == {"city": "Tokyo"}
    assert card.locator(".status").inner_text() == "result"
    assert card.locator("pre.result").inner_text() == "The local time in Tokyo is 09:41."
    assert "09:41" in answer.locator(".body").inner_text()

    card, answer = ask_and_decide(page, "no")
    assert card.locator(".status").inner_text() == "declined"
    assert "The user declined to run this tool call" in card.locator("pre.result").inner_text()
    assert "09:41" not in answer.locator(".body").inner_text()
    page.close()


def served_with(coder_home, tmp_path_factory, servers: dict) -> Iterator[str]:
    home = private_home(coder_home, tmp_path_factory.mktemp("mcp-web"))
    (home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    settings = {"LOCALLLM_MCP": "1", "LOCALLLM_MCP_CONFIG": str(home / "mcp.json"), "LOCALLLM_CONTEXT_LENGTH": "2048"}
    with served(home, **settings) as url:
        yield url


@pytest.fixture(scope="module")
def notes_url(coder_home, tmp_path_factory) -> Iterator[str]:
    """The edge server's prompt and resource, and no tools (the model answers without calling one)."""
    yield from served_with(
        coder_home, tmp_path_factory, {"notes": {"command": sys.executable, "args": [str(EDGE_SERVER), "none"]}}
    )


def test_a_resource_is_attached_and_a_prompt_sends_its_messages(browser, notes_url):  # noqa: F811
    page = open_page(browser, notes_url)
    start_chat(page)
    picker = page.locator("#mcp-pick")
    wait_until(picker.is_visible)
    picker.select_option("resource:note://greeting")
    page.wait_for_selector("#attachments .chip")
    assert page.locator("#attachments .chip").inner_text().startswith("note://greeting")
    send(page, "What is the password of the day? Answer with the password only.")
    answer = wait_for_answer(page)
    assert "swordfish" in answer.locator(".body").inner_text().lower()

    start_chat(page)
    picker.select_option("prompt:haiku")
    assert page.input_value("#prompt") == "/prompt haiku "
    send(page, "/prompt haiku rain")
    wait_for_answer(page)
    assert page.locator("#messages article.user .body").last.inner_text() == "Write a haiku about rain."

    send(page, "/prompt haiku")  # its argument left out: said, nothing sent
    wait_until(page.locator("#error").is_visible)
    assert "needs topic" in page.locator("#error").inner_text()
    page.close()


@pytest.fixture(scope="module")
def stuck(coder_home, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A tool that never answers and writes down its cancellation (tests/mcp_edge_server.py)."""
    cancelled = tmp_path_factory.mktemp("mcp-stuck") / "cancelled"
    entry = {
        "command": sys.executable,
        "args": [str(EDGE_SERVER), "hang"],
        "timeout": 600,
        "env": {"EDGE_CANCELLED": str(cancelled)},
    }
    for url in served_with(coder_home, tmp_path_factory, {"stuck": entry}):
        yield url, cancelled


def test_stop_while_a_tool_runs_cancels_it_on_the_server(browser, stuck):  # noqa: F811
    url, cancelled = stuck
    page = open_page(browser, url)
    start_chat(page)
    send(page, "What time is it in Tokyo? Use the hang tool.")
    card = page.locator("#messages article.tool").last
    card.locator("button[data-decision=yes]").click()
    page.wait_for_selector("#messages article.tool.running")
    page.click("#stop")
    wait_until(cancelled.exists, seconds=60)  # the MCP server was told, while the server still runs
    assert cancelled.read_text() == "cancelled\n"
    assert card.locator(".status").inner_text() == "stopped"
    assert "stopped this tool call" in card.locator("pre.result").inner_text()
    page.close()
