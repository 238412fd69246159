"""The TUI through Textual's Pilot: pick a model and chat with the real smollm2 (in-process client), pull a model
from a loopback HTTP server with progress, delete it, edit the system prompt and parameters, stop an answer, and an
unreachable server shown as a notice. Snapshot tests of the main screens use a scripted client behind the real
Client Protocol, so their pictures do not depend on the model or the clock."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import threading
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from textual import events
from textual.widgets import DataTable, TextArea
from textual.widgets._toast import Toast

from localllm import api
from localllm.errors import ModelNotFound
from localllm.tui.app import LocalLLMApp
from localllm.tui.screens.chat import ChatScreen
from localllm.tui.screens.dialogs import SettingsScreen, parse_options
from localllm.tui.screens.models import ModelsScreen
from localllm.tui.widgets.engine_panel import EnginePanel
from localllm.tui.widgets.message_list import MessageList
from localllm.tui.widgets.model_views import PullView
from localllm.tui.widgets.prompt_input import PromptInput

pytestmark = pytest.mark.anyio

SYSTEM = "You are a helpful AI assistant."
SIZE = (100, 30)


# ---------------------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def real_client(models_home):
    """The in-process client on the shared test home (read-only here: nothing is pulled or deleted)."""
    from localllm.client.local import LocalClient
    from localllm.models.store import Store

    client = LocalClient(store=Store(models_home / "models"))
    yield client
    client.close()


async def settle(pilot) -> None:
    """Let every worker finish, then let the messages they posted be handled."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


async def wait_for_answer(pilot, *, limit: int = 600) -> None:
    screen = pilot.app.screen
    for _ in range(limit):
        if not screen._answering:
            return
        await pilot.pause(0.1)
    raise AssertionError("the answer did not finish")


def notices(app) -> list[str]:
    """The text of the notification toasts on screen."""
    return [str(toast.render()) for toast in app.screen.query(Toast)]


async def type_text(pilot, text: str) -> None:
    await pilot.press(*["space" if char == " " else char for char in text])


async def pick_model(pilot, name: str) -> None:
    await pilot.press("f2")
    await settle(pilot)
    table = pilot.app.screen.query_one(DataTable)
    names = [table.get_row_at(row)[0] for row in range(table.row_count)]
    assert name in names
    while table.get_row_at(table.cursor_row)[0] != name:
        await pilot.press("down")
    await pilot.press("enter")
    await pilot.pause()


# ---------------------------------------------------------------------------------------------------------- chat


async def test_pick_a_model_send_a_message_and_see_the_streamed_answer(real_client):
    app = LocalLLMApp(real_client, system=SYSTEM, options={"temperature": 0, "num_predict": 24})
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pick_model(pilot, "smollm2:135m")
        assert isinstance(app.screen, ChatScreen)
        assert app.conversation.model == "smollm2:135m"
        await type_text(pilot, "What is the capital of France?")
        await pilot.press("enter")
        await wait_for_answer(pilot)
        await settle(pilot)

        answer = app.screen.query_one(MessageList).last_answer()
        assert "Paris" in answer
        assert [m.role for m in app.conversation.messages] == ["user", "assistant"]
        assert app.conversation.messages[1].content == answer
        figures = app.screen.query_one(EnginePanel).figures
        assert figures.server == "connected"
        assert figures.process is not None and figures.process.name == "smollm2:135m"
        assert figures.last_rate is not None and figures.last_rate > 0
        assert figures.prompt_tokens > 0


async def test_escape_stops_a_long_answer_and_the_chat_goes_on(real_client):
    app = LocalLLMApp(real_client, model="smollm2:135m", system=SYSTEM, options={"temperature": 0, "num_predict": 2000})
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await type_text(pilot, "Write a very long story about a dragon.")
        await pilot.press("enter")
        messages = app.screen.query_one(MessageList)
        for _ in range(300):  # until some of the answer is on screen
            if len(messages.last_answer()) > 40:
                break
            await pilot.pause(0.1)
        await pilot.press("escape")
        await wait_for_answer(pilot)
        await settle(pilot)
        stopped = app.conversation.messages[-1]
        assert stopped.role == "assistant" and stopped.content
        assert app.conversation.figures.answers == 0  # stopped answers carry no timings

        app.conversation.options["num_predict"] = 8
        await type_text(pilot, "Hi")
        await pilot.press("enter")
        await wait_for_answer(pilot)
        await settle(pilot)
        assert [m.role for m in app.conversation.messages] == ["user", "assistant", "user", "assistant"]
        assert app.conversation.figures.answers == 1


async def test_settings_dialog_sets_the_system_prompt_and_parameters():
    app = LocalLLMApp(ScriptedClient(), model="smollm2:135m")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("f3")
        await settle(pilot)
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#system", TextArea).text = "You are terse."
        app.screen.query_one("#parameters", TextArea).text = "temperature hot"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)  # a bad value keeps the dialog open and says why
        assert any("temperature" in text for text in notices(app))

        app.screen.query_one("#parameters", TextArea).text = "temperature 0\nstop END ###\nnum_ctx 1024"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, ChatScreen)
        assert app.conversation.system == "You are terse."
        assert app.conversation.options == {"temperature": 0.0, "stop": ["END", "###"], "num_ctx": 1024}
        assert app.conversation.request().messages[0].content == "You are terse."


def test_parameter_lines_are_checked_and_name_the_line():
    assert parse_options("# comment\n\ntop_k 5\nseed 7") == {"top_k": 5, "seed": 7}
    with pytest.raises(Exception, match="line 2: unknown parameter 'temprature'; did you mean 'temperature'"):
        parse_options("top_k 5\ntemprature 1")


async def test_unreachable_server_shows_a_clear_notice_not_a_traceback():
    from localllm.client.http import HttpClient

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = LocalLLMApp(HttpClient(f"http://127.0.0.1:{port}"), model="smollm2:135m")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        assert any("no localllm server answers" in text and "localllm serve" in text for text in notices(app))
        assert app.screen.query_one(EnginePanel).figures.server == "unreachable"

        await type_text(pilot, "Hello")
        await pilot.press("enter")
        await settle(pilot)
        assert any(text.startswith("Answer failed") for text in notices(app))
        assert app.conversation.messages == []  # the unanswered question is withdrawn
        assert app.is_running


# ---------------------------------------------------------------------------------------------------------- models


@pytest.fixture
def file_server(tmp_path, smollm2_path) -> Iterator[str]:
    """A loopback HTTP server with smollm2 as /tiny-chat.gguf."""
    folder = tmp_path / "served"
    folder.mkdir()
    os.symlink(smollm2_path, folder / "tiny-chat.gguf")
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


async def test_pull_shows_progress_then_the_model_can_be_deleted(file_server, smollm2_path):
    from localllm.client.local import LocalClient

    client = LocalClient()  # on this test's empty home
    app = LocalLLMApp(client)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await pilot.press("f2")
            await settle(pilot)
            table = app.screen.query_one(DataTable)
            assert table.row_count == 0
            await pilot.press("p")
            await type_text(pilot, f"{file_server}/tiny-chat.gguf")
            await pilot.press("enter")
            await settle(pilot)

            view = app.screen.query_one(PullView)
            assert view.display and view.status == "success"
            assert view.completed == smollm2_path.stat().st_size
            assert [table.get_row_at(row)[0] for row in range(table.row_count)] == ["tiny-chat:latest"]

            table.focus()
            await pilot.press("d")
            await pilot.pause()
            await pilot.press("y")
            await settle(pilot)
            assert table.row_count == 0
            assert client.list_models().models == []
    finally:
        client.close()


async def test_a_failed_pull_is_a_notice():
    app = LocalLLMApp(ScriptedClient())
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("f2")
        await settle(pilot)
        await pilot.press("p")
        await type_text(pilot, "nosuch:1b")
        await pilot.press("enter")
        await settle(pilot)
        assert any(
            text.startswith("Pull of nosuch:1b failed") and "not in the catalog" in text for text in notices(app)
        )
        assert isinstance(app.screen, ModelsScreen)


# ---------------------------------------------------------------------------------------------------------- snapshots

MODIFIED = datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)
ANSWER = [
    "The capital of **France** is Paris.\n\n",
    "Three facts:\n\n",
    "1. It is on the Seine.\n",
    "2. It has the Louvre.\n",
    "3. It hosted the 2024 Olympics.\n\n",
    "```python\nprint('Paris')\n```\n",
]


class ScriptedClient:
    """The Client Protocol with fixed answers, for pictures that must not change from run to run."""

    def __init__(self):
        details = api.ModelDetails(family="llama", parameter_size="135M", quantization_level="Q4_1")
        self.models = [
            api.ModelSummary(name=name, model=name, modified_at=MODIFIED, size=size, digest="0" * 64, details=details)
            for name, size in (("smollm2:135m", 98_362_432), ("gemma3:270m", 253_114_368))
        ]

    def version(self) -> str:
        return "0.0.0"

    def list_models(self) -> api.ListResponse:
        return api.ListResponse(models=self.models)

    def show(self, model: str) -> api.ShowResponse:
        return api.ShowResponse(
            details=self.models[0].details,
            system=SYSTEM,
            capabilities=["completion"],
            parameters="temperature             0.2",
            model_info={"general.architecture": "llama", "llama.context_length": 8192},
        )

    def pull(self, model: str):
        raise ModelNotFound(f"model {model!r} is not in the catalog")

    def create(self, request):
        yield api.PullProgress(status="success")

    def copy(self, source: str, destination: str) -> None:
        pass

    def delete(self, model: str) -> None:
        pass

    def ps(self) -> api.ProcessResponse:
        return api.ProcessResponse(
            models=[
                api.ProcessModel(
                    name="smollm2:135m",
                    model="smollm2:135m",
                    slots_total=4,
                    context_length=4096,
                    threads=2,
                    threads_auto=True,
                )
            ]
        )

    def stop(self, model: str) -> None:
        pass

    def generate(self, request):
        raise NotImplementedError

    def chat(self, request: api.ChatRequest):
        for piece in ANSWER:
            yield api.ChatChunk(model=request.model, message=api.Message(role="assistant", content=piece))
        yield api.ChatChunk(
            model=request.model,
            done=True,
            done_reason="stop",
            prompt_eval_count=40,
            prompt_cache_count=30,
            eval_count=60,
            eval_duration=1_000_000_000,
        )

    def embed(self, request):
        raise NotImplementedError


def _still_cursor(pilot) -> None:
    for area in pilot.app.screen.query(TextArea):
        area.cursor_blink = False


def test_snapshot_chat_screen(snap_compare):
    async def ask(pilot):
        _still_cursor(pilot)
        await type_text(pilot, "What is the capital of France?")
        await pilot.press("enter")
        await wait_for_answer(pilot)
        await settle(pilot)

    assert snap_compare(LocalLLMApp(ScriptedClient(), model="smollm2:135m"), run_before=ask, terminal_size=SIZE)


def test_snapshot_models_screen(snap_compare):
    async def open_models(pilot):
        await pilot.press("f2")
        await settle(pilot)
        await pilot.press("down")
        await settle(pilot)

    assert snap_compare(LocalLLMApp(ScriptedClient(), model="smollm2:135m"), run_before=open_models, terminal_size=SIZE)


def test_snapshot_settings_dialog(snap_compare):
    async def open_settings(pilot):
        await pilot.press("f3")
        await settle(pilot)
        _still_cursor(pilot)

    app = LocalLLMApp(
        ScriptedClient(), model="smollm2:135m", system=SYSTEM, options={"temperature": 0, "num_predict": 64}
    )
    assert snap_compare(app, run_before=open_settings, terminal_size=SIZE)


async def test_prompt_keeps_pasted_newlines_and_ctrl_j_adds_one():
    app = LocalLLMApp(ScriptedClient(), model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.screen.query_one(PromptInput)
        app.post_message(events.Paste("first line\nsecond line"))  # what the terminal driver sends
        await pilot.pause()
        await pilot.press("ctrl+j")
        await type_text(pilot, "third")
        await pilot.press("enter")
        await wait_for_answer(pilot)
        await settle(pilot)
        assert app.conversation.messages[0].content == "first line\nsecond line\nthird"
        assert prompt.text == ""


# ---------------------------------------------------------------------------------------------------------- issue 22

MODEL_PARAMETERS = (
    'stop                    "<|im_start|>"\nstop                    "<|im_end|>"\n'
    "temperature             0.2\nnum_ctx                 8192"
)


class ModelDefaultsClient(ScriptedClient):
    """A model with its own SYSTEM and several parameters, and answers that stream until stopped (bounded)."""

    def show(self, model: str) -> api.ShowResponse:
        return super().show(model).model_copy(update={"parameters": MODEL_PARAMETERS})

    def chat(self, request: api.ChatRequest):
        import time

        for n in range(600):
            yield api.ChatChunk(model=request.model, message=api.Message(role="assistant", content=f"word{n} "))
            time.sleep(0.02)
        yield api.ChatChunk(model=request.model, done=True, done_reason="length")


async def test_a_stopped_answer_is_marked_and_a_finished_one_is_not():
    app = LocalLLMApp(ModelDefaultsClient(), model="smollm2:135m")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await type_text(pilot, "Talk")
        await pilot.press("enter")
        messages = app.screen.query_one(MessageList)
        for _ in range(300):
            if "word3" in messages.last_answer():
                break
            await pilot.pause(0.1)
        await pilot.press("escape")
        await wait_for_answer(pilot)
        await settle(pilot)
        assert messages.last_answer().rstrip().endswith("(stopped)*")
        assert "(stopped)" not in app.conversation.messages[-1].content  # the mark is not part of the answer

    app = LocalLLMApp(ScriptedClient(), model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        await type_text(pilot, "Hi")
        await pilot.press("enter")
        await wait_for_answer(pilot)
        await settle(pilot)
        assert "(stopped)" not in app.screen.query_one(MessageList).last_answer()


async def test_f3_opens_with_the_models_own_system_and_parameters():
    app = LocalLLMApp(ModelDefaultsClient(), model="smollm2:135m", options={"temperature": 0.7})
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("f3")
        await settle(pilot)
        assert isinstance(app.screen, SettingsScreen)
        assert app.screen.query_one("#system", TextArea).text == SYSTEM
        lines = app.screen.query_one("#parameters", TextArea).text.splitlines()
        # the model's values, with what this chat set on top
        assert lines == ["stop <|im_start|> <|im_end|>", "temperature 0.7", "num_ctx 8192"]


async def test_the_details_pane_keeps_one_parameter_per_line():
    app = LocalLLMApp(ModelDefaultsClient(), model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await settle(pilot)
        details = app.screen.query_one("#details")
        shown = [details.render_line(y).text.rstrip() for y in range(details.size.height)]
        values = [line.split("Parameters set", 1)[-1].strip() for line in shown]
        start = next(i for i, line in enumerate(shown) if "Parameters set" in line)
        assert values[start : start + 4] == [
            'stop "<|im_start|>"',
            'stop "<|im_end|>"',
            "temperature 0.2",
            "num_ctx 8192",
        ]
