"""Streams open when the engine takes the request, not at the first token, and stay alive while they have nothing to
say (issue 46): agents give up on a stream whose headers or events do not come for minutes, and a long prompt
prefills for that long on a CPU. The real server on smollm2:135m with one thread, so that a long prompt prefills for
seconds; nothing here asserts a time: the checks read the server's own state while the stream waits."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from server_harness import private_home, served

from localllm.server import chunk_stream

pytestmark = pytest.mark.models

MODEL = "smollm2:135m"
ROUTES = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
# Events of the opening: message_start and a ping; the role chunk; response.created and response.in_progress.
OPENING = {"/v1/messages": 2, "/v1/chat/completions": 1, "/v1/responses": 2}
KEEP_ALIVES = (b"event: ping", b": keep-alive")
FREED_SECONDS = 60  # far more than a step takes on a loaded machine: a slot freed by then was freed by the leave


@pytest.fixture(scope="module")
def url(models_home, tmp_path_factory) -> Iterator[str]:
    home = private_home(models_home, tmp_path_factory.mktemp("opening"))  # no prefix cached from other tests
    settings = {"LOCALLLM_NUM_THREAD": "1", "LOCALLLM_CONTEXT_LENGTH": "4096", "LOCALLLM_NUM_PARALLEL": "1"}
    with served(home, **settings) as base:
        yield base


@pytest.fixture
def quick_keep_alive(monkeypatch):
    monkeypatch.setattr(chunk_stream, "KEEP_ALIVE_SECONDS", 0.2)  # the server runs in this process


def long_text(tag: str) -> str:
    """About 3,000 tokens, opened by `tag` so that no two requests share a cached prefix."""
    return tag + ": " + " ".join(f"line {i} of the log says the build passed" for i in range(330))


def body(route: str, text: str, max_tokens: int) -> dict:
    if route == "/v1/responses":
        return {"model": MODEL, "input": text, "stream": True, "max_output_tokens": max_tokens, "temperature": 0}
    messages = [{"role": "user", "content": text}]
    return {"model": MODEL, "messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0}


def events(response: httpx.Response) -> Iterator[bytes]:
    """Each server-sent event's text, keep-alives included (an SSE comment is an event of its own here)."""
    pending = b""
    for piece in response.iter_bytes():
        pending += piece
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            yield event


def data_of(event: bytes) -> dict | str:
    line = next(line for line in event.split(b"\n") if line.startswith(b"data: "))
    text = line.removeprefix(b"data: ").decode()
    return text if text == "[DONE]" else json.loads(text)


def is_keep_alive(event: bytes) -> bool:
    return event.startswith(KEEP_ALIVES)


def ps_row(url: str) -> dict:
    [row] = httpx.get(url + "/api/ps", timeout=30).json()["models"]
    return row


def prompt_tokens(url: str, text: str) -> int:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    return httpx.post(url + "/api/count_tokens", json=chat, timeout=60).json()["input_tokens"]


def opening_of(route: str, first: dict | str) -> bool:
    """Whether `first` is the route's opening event: message_start, the role chunk, response.created."""
    assert isinstance(first, dict)
    if route == "/v1/messages":
        return first["type"] == "message_start"
    if route == "/v1/responses":
        return first["type"] == "response.created"
    return first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def finished(route: str, event: bytes) -> bool:
    data = data_of(event)
    if route == "/v1/chat/completions":
        return data == "[DONE]"
    assert isinstance(data, dict)
    return data["type"] in ("message_stop", "response.completed", "response.incomplete")


def wait_for(condition, seconds: float = FREED_SECONDS) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def warm(url: str) -> None:
    """The model loaded, so that a request's wait is its own prefill, not the load."""
    httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "Hi", "options": {"num_predict": 1}}, timeout=300)


@pytest.mark.parametrize("route", ROUTES)
def test_a_stream_opens_while_its_prompt_prefills_and_keeps_alive(url, route, quick_keep_alive):
    warm(url)
    text = long_text(f"prefill {route}")
    total = prompt_tokens(url, text)
    with httpx.stream("POST", url + route, json=body(route, text, 2), timeout=300) as response:
        assert response.status_code == 200
        stream = events(response)
        assert opening_of(route, data_of(next(stream)))
        # The opening came while the engine holds the prompt in a slot, part of it still to prefill.
        row = ps_row(url)
        assert row["slots_busy"] == 1 and row["kv_used"] < total, (row["kv_used"], total)
        rest = list(stream)[OPENING[route] - 1 :]
    silence = rest[: next(i for i, event in enumerate(rest) if not is_keep_alive(event))]
    assert silence and all(is_keep_alive(event) for event in silence)  # the prefill, kept alive
    assert finished(route, rest[-1])


@pytest.mark.parametrize("route", ROUTES)
def test_a_queued_stream_opens_at_once_and_answers_when_its_turn_comes(url, route, quick_keep_alive):
    warm(url)
    hold = {"model": MODEL, "prompt": "Count to a million.", "options": {"num_predict": 4000, "ignore_eos": True}}
    with httpx.stream("POST", url + "/api/generate", json=hold, timeout=300) as holder:
        held = holder.iter_lines()  # kept: dropping the iterator closes the connection
        next(held)  # the one slot is taken
        text = f"Name a colour ({route})."
        with httpx.stream("POST", url + route, json=body(route, text, 4), timeout=300) as response:
            assert response.status_code == 200
            stream = events(response)
            first = data_of(next(stream))
            assert opening_of(route, first)
            if route == "/v1/messages":  # waiting for a slot, no part of the prompt is known to be cached
                assert isinstance(first, dict)
                usage = first["message"]["usage"]
                counted = httpx.post(url + "/v1/messages/count_tokens", json=body(route, text, 4)).json()
                assert usage["input_tokens"] == counted["input_tokens"] and usage["cache_read_input_tokens"] == 0
            row = ps_row(url)
            assert row["queue_depth"] == 1  # still waiting: not a token of it exists
            for _ in range(OPENING[route] - 1):
                next(stream)
            assert is_keep_alive(next(stream))  # the wait, kept alive
            holder.close()  # the slot comes free
            assert finished(route, list(stream)[-1])


@pytest.mark.parametrize("route", ROUTES)
def test_errors_before_admission_are_still_statuses(url, route):
    unknown = httpx.post(url + route, json={**body(route, "Hi", 2), "model": "no-such-model"}, timeout=60)
    assert unknown.status_code == 404, unknown.text
    overflow = httpx.post(url + route, json=body(route, long_text("overflow") * 2, 2), timeout=60)
    assert overflow.status_code == 400 and "context" in overflow.text, overflow.text


@pytest.mark.parametrize("route", ROUTES)
def test_a_client_that_leaves_mid_answer_frees_its_slot(url, route):
    warm(url)
    long_answer = {**body(route, f"Tell a long story ({route}).", 3000)}
    with httpx.stream("POST", url + route, json=long_answer, timeout=300) as response:
        said = (event for event in events(response) if not is_keep_alive(event))
        for _ in range(6):
            next(said)
        assert ps_row(url)["slots_busy"] == 1
    assert wait_for(lambda: ps_row(url)["slots_busy"] == 0)


def test_a_client_that_leaves_during_the_prefill_frees_its_slot(url):
    warm(url)
    with httpx.stream("POST", url + "/v1/messages", json=body("/v1/messages", long_text("leave"), 2), timeout=300) as r:
        opened = events(r)
        next(opened)
        assert ps_row(url)["slots_busy"] == 1
    assert wait_for(lambda: ps_row(url)["slots_busy"] == 0)


def test_pump_threads_are_kept_for_later_streams_and_leave_when_idle():
    import threading

    pumps = chunk_stream._PumpThreads()
    ran: list[threading.Thread] = []
    done = threading.Semaphore(0)

    def job() -> None:
        ran.append(threading.current_thread())
        done.release()

    pumps.run(job)
    assert done.acquire(timeout=30)
    # once the first thread is back in the pool (its idle count says so), a second stream takes it, not a new thread
    assert wait_for(lambda: pumps._idle == 1)
    pumps.run(job)
    assert done.acquire(timeout=30)
    assert ran[0] is ran[1]

    # two streams at once get two threads
    gate = threading.Event()
    started = threading.Semaphore(0)

    def held() -> None:
        ran.append(threading.current_thread())
        started.release()
        gate.wait(30)

    pumps.run(held)
    pumps.run(held)
    assert started.acquire(timeout=30) and started.acquire(timeout=30)
    assert ran[2] is not ran[3]
    pumps.IDLE_SECONDS = 0.05  # idle threads leave
    gate.set()
    for thread in {ran[2], ran[3]}:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert pumps._idle == 0
