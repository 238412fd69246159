"""The TUI shows a reasoning model's thinking in a collapsible above the answer (smollm2 under a reasoning template,
tests/reasoning_model.py, through the real in-process client and Textual's Pilot)."""

from __future__ import annotations

import pytest

from localllm.tui.app import LocalLLMApp
from localllm.tui.widgets.message_list import MessageList, ThinkingView

pytestmark = [pytest.mark.anyio, pytest.mark.models]


@pytest.fixture(scope="module")
def reasoner(reasoner_path) -> str:
    return str(reasoner_path)


@pytest.fixture(scope="module")
def client(models_home):
    from localllm.client.local import LocalClient
    from localllm.models.store import Store

    client = LocalClient(store=Store(models_home / "models"))
    yield client
    client.close()


async def ask(pilot, text: str) -> None:
    await pilot.press(*["space" if char == " " else char for char in text], "enter")
    for _ in range(600):
        if not pilot.app.screen._answering:
            break
        await pilot.pause(0.1)
    await pilot.pause(0.2)


async def test_thinking_is_collapsible_above_the_answer(client, reasoner):
    app = LocalLLMApp(client, model=reasoner, options={"temperature": 0, "num_predict": 24})
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(pilot, "What is the capital of France?")
        views = list(app.screen.query(ThinkingView))
        assert len(views) == 1 and "Paris" in views[0].text and "<think>" not in views[0].text
        assert views[0].collapsed and views[0].title == "Thinking"  # folded once the answer is over
        messages = app.screen.query_one(MessageList)
        assert list(messages.children).index(views[0]) == len(messages.children) - 2  # right above the answer
        answer = app.conversation.messages[-1]  # only thinking, kept so the history alternates
        assert answer.role == "assistant" and answer.content == "" and answer.thinking == views[0].text

        app.conversation.think = False
        await ask(pilot, "What is the capital of France?")
        assert len(app.screen.query(ThinkingView)) == 1  # no thinking this time: the answer alone
        assert messages.last_answer().strip()
        assert [m.role for m in app.conversation.messages] == ["user", "assistant"] * 2
