"""The request service (client/, issue 45): a request's options are resolved once, and every stream a Client hands
out is typed (next, close, cancel), LocalClient's and HttpClient's alike, so a cancel from another thread ends it."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_harness import env, local_client, served

from localllm import api
from localllm.client import local
from localllm.client.http import HttpClient
from localllm.errors import InvalidInput

pytestmark = pytest.mark.models

MODEL = "smollm2:135m"
SMALL = {"temperature": 0, "num_predict": 4}
# An answer that runs until cancelled: long enough that a cancel lands well before it ends, whatever the model says.
LONG = {"temperature": 0, "num_predict": 400, "ignore_eos": True}
HI = [api.Message(role="user", content="Count from one to a hundred.")]
SETTINGS = {"LOCALLLM_CONTEXT_LENGTH": "1024", "LOCALLLM_NUM_PARALLEL": "2"}


@pytest.fixture(scope="module")
def client(models_home):
    with env(**SETTINGS):
        client = local_client(models_home)
        try:
            yield client
        finally:
            client.close()


@pytest.fixture(scope="module")
def base_url(models_home):
    with served(models_home, **SETTINGS) as url:
        yield url


def test_each_request_resolves_its_options_once(client, monkeypatch):
    calls: list[dict | None] = []
    real = local.resolve_options

    def counting(model, options):
        calls.append(options)
        return real(model, options)

    monkeypatch.setattr(local, "resolve_options", counting)

    def resolved(run) -> int:
        calls.clear()
        run()
        return len(calls)

    chat = api.ChatRequest(model=MODEL, messages=HI, options=SMALL)
    generate = api.GenerateRequest(model=MODEL, prompt="Say hi", options=SMALL)
    choices = [chat, chat.model_copy(update={"options": {**SMALL, "seed": 7}})]  # OpenAI's n=2 with a seed
    assert resolved(lambda: list(client.chat(chat))) == 1
    assert resolved(lambda: list(client.generate(generate))) == 1
    assert resolved(lambda: list(client.chat_batch(choices))) == 2


def test_a_batch_that_loads_two_ways_is_refused(client):
    two = [
        api.ChatRequest(model=MODEL, messages=HI, options={**SMALL, "num_ctx": 512}),
        api.ChatRequest(model=MODEL, messages=HI, options={**SMALL, "num_ctx": 1024}),
    ]
    with pytest.raises(InvalidInput, match="num_ctx"):
        list(client.chat_batch(two))


def _cancelled_from_another_thread(stream) -> tuple[api.ChatChunk, list[api.ChatChunk]]:
    """The first chunk, then what the stream still gives after another thread cancels it."""
    try:
        first = next(stream)
        canceller = threading.Thread(target=stream.cancel)
        canceller.start()
        canceller.join()
        return first, list(stream)
    finally:
        stream.close()


def test_a_local_stream_cancelled_from_another_thread_ends(client):
    first, rest = _cancelled_from_another_thread(client.chat(api.ChatRequest(model=MODEL, messages=HI, options=LONG)))
    assert not first.done
    assert rest[-1].done and rest[-1].done_reason == "cancelled"


def test_an_http_stream_cancelled_from_another_thread_ends(base_url):
    with HttpClient(base_url) as http:
        stream = http.chat(api.ChatRequest(model=MODEL, messages=HI, options=LONG))
        first, rest = _cancelled_from_another_thread(stream)
        # The connection is closed: what was already read may still come, the answer's end never does.
        assert not first.done and not any(chunk.done for chunk in rest)
        assert http.version()  # the client itself is still open: a cancel closes one response


def test_a_closed_http_client_refuses_to_send(base_url):
    http = HttpClient(base_url)
    http.close()
    with pytest.raises(RuntimeError, match="closed"):
        http.version()


def test_a_bad_infill_keep_alive_is_a_400_naming_it(base_url):
    body = {"model": MODEL, "input_prefix": "def f(", "input_suffix": ")", "keep_alive": "soon"}
    reply = httpx.post(base_url + "/infill", json=body, timeout=60)
    assert reply.status_code == 400 and "keep_alive" in reply.json()["error"]
