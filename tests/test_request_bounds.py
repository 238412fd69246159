"""Bounded before the work, on every route: embedding inputs are counted, embedded a batch at a time (a small request
takes its turn beside a large one) and dropped when their client leaves; text far larger than the context is refused
before it is templated or tokenized; images are budgeted in pixels before one is decoded; 0 tokens means 0; a
conversation's messages are counted and parsed off the event loop. The real server on loopback, real models."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from server_harness import env, local_client, serve_in_thread

from localllm import api
from localllm.client import prompts

EMBEDDER = "nomic-embed-text"
DEADLINE = 300.0  # far above the work each wait stands for: a stuck request fails the test, a slow one does not


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


def post_and_keep(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a raw connection and read nothing: closing the socket is the client leaving."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.fixture(scope="module")
def embed_server(embed_home):
    with env(LOCALLLM_NUM_PARALLEL="1"):
        client = local_client(embed_home)
        try:
            from localllm.server.app import create_app

            with serve_in_thread(create_app(client)) as url:
                yield url, client
        finally:
            client.close()


# ---------------------------------------------------------------------------------------------------------- embeddings


@pytest.mark.models
def test_more_embedding_inputs_than_the_cap_are_a_400_naming_it(embed_server):
    url, _ = embed_server
    inputs = ["a"] * (api.MAX_EMBED_INPUTS + 1)
    for path, body in (
        ("/api/embed", {"model": EMBEDDER, "input": inputs}),
        ("/v1/embeddings", {"model": EMBEDDER, "input": inputs}),
    ):
        reply = httpx.post(url + path, json=body, timeout=DEADLINE)
        assert reply.status_code == 400, (path, reply.text)
        assert f"{api.MAX_EMBED_INPUTS:,}" in reply.text


@pytest.mark.models
def test_a_small_embed_takes_its_turn_beside_a_large_one_which_stops_when_its_client_leaves(embed_server):
    url, client = embed_server
    assert httpx.post(url + "/api/embed", json={"model": EMBEDDER, "input": "load"}, timeout=DEADLINE).is_success
    (entry,) = client.pool.entries()
    engine = entry.engine
    before = engine.snapshot().embedded_inputs
    large = [f"search_document: note number {i}" for i in range(api.MAX_EMBED_INPUTS)]
    sock = post_and_keep(url, "/api/embed", {"model": EMBEDDER, "input": large})
    try:
        wait_until(lambda: engine.snapshot().embedded_inputs > before, "the large request's first batch")
        one = {"model": EMBEDDER, "input": "search_query: cats"}
        small = httpx.post(url + "/api/embed", json=one, timeout=DEADLINE)
        assert small.status_code == 200 and len(small.json()["embeddings"]) == 1
        # The small one was answered while the large one still had inputs to go: it did not wait behind it.
        assert engine.snapshot().embedded_inputs < before + len(large) + 1
    finally:
        sock.close()
    wait_until(lambda: engine.snapshot().embeds_dropped == 1, "the large request to be dropped")
    assert engine.snapshot().embedded_inputs < before + len(large) + 1


# ---------------------------------------------------------------------------------------------------------- text size


@pytest.fixture(scope="module")
def small_url(models_home):
    from server_harness import served

    with served(models_home, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="1") as url:
        yield url


@pytest.mark.models
def test_text_far_larger_than_the_context_is_refused_naming_its_size_on_every_route(small_url, embed_server):
    bound = prompts.prompt_chars_bound(1024)
    text = "a = 1\n" * (bound // 6 + 100)
    shown = f"{len(text):,} characters"
    requests = [
        ("/api/generate", {"model": "smollm2:135m", "prompt": text, "stream": False}),
        ("/api/generate", {"model": "smollm2:135m", "prompt": text, "raw": True, "stream": False}),
        ("/api/chat", {"model": "smollm2:135m", "messages": [{"role": "user", "content": text}], "stream": False}),
        ("/v1/chat/completions", {"model": "smollm2:135m", "messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"model": "smollm2:135m", "prompt": text}),
        ("/v1/messages", {"model": "smollm2:135m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}),
        ("/infill", {"model": "smollm2:135m", "input_prefix": text, "input_suffix": ""}),
        ("/api/count_tokens", {"model": "smollm2:135m", "messages": [{"role": "user", "content": text}]}),
    ]
    for path, body in requests:
        reply = httpx.post(small_url + path, json=body, timeout=DEADLINE)
        assert reply.status_code == 413, (path, reply.status_code, reply.text[:300])
        assert shown in reply.text and f"{bound:,}" in reply.text, (path, reply.text[:300])
        assert "template" not in reply.text, path


@pytest.mark.models
def test_an_embedding_input_far_larger_than_the_context_is_refused(embed_server):
    url, _ = embed_server
    body = {"model": EMBEDDER, "input": ["ok", "x" * 10_000_000]}
    reply = httpx.post(url + "/api/embed", json=body, timeout=DEADLINE)
    assert reply.status_code == 413 and "input 1 is 10,000,000 characters" in reply.text


@pytest.mark.models
def test_infill_on_a_model_without_fim_tokens_is_a_400(small_url):
    body = {"model": "smollm2:135m", "input_prefix": "def add(a, b):\n    return ", "input_suffix": "", "n_predict": 4}
    reply = httpx.post(small_url + "/infill", json=body, timeout=DEADLINE)
    assert reply.status_code == 400 and "fill in the middle" in reply.text


# ---------------------------------------------------------------------------------------------------------- zero tokens


@pytest.mark.models
def test_zero_tokens_is_a_400_on_openai_routes_and_no_tokens_on_the_others(small_url, coder_url):
    chat = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Hi"}]}
    for path, body in (
        ("/v1/completions", {"model": "smollm2:135m", "prompt": "Once upon", "max_tokens": 0}),
        ("/v1/chat/completions", {**chat, "max_tokens": 0}),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}),
    ):
        reply = httpx.post(small_url + path, json=body, timeout=DEADLINE)
        assert reply.status_code == 400 and "max_" in reply.text, (path, reply.text)
    zero = {"num_predict": 0, "temperature": 0}
    generated = httpx.post(
        small_url + "/api/generate",
        json={"model": "smollm2:135m", "prompt": "Once upon", "options": zero, "stream": False},
        timeout=DEADLINE,
    ).json()
    assert generated["done"] and generated["eval_count"] == 0 and generated["response"] == ""
    chatted = httpx.post(small_url + "/api/chat", json={**chat, "options": zero, "stream": False}, timeout=DEADLINE)
    assert chatted.json()["eval_count"] == 0 and chatted.json()["message"]["content"] == ""
    infill = {"model": "coder-pinned", "input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n"}
    infill["n_predict"] = 0
    filled = httpx.post(coder_url + "/infill", json=infill, timeout=DEADLINE).json()
    assert filled["content"] == "" and filled["tokens_predicted"] == 0 and filled["stop"]


# ---------------------------------------------------------------------------------------------------------- images


def _png(width: int, height: int) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_images_over_the_request_pixel_budget_are_refused_before_any_is_decoded(monkeypatch):
    from PIL import Image

    from localllm.client import images
    from localllm.errors import InvalidInput

    decoded = []
    real = Image.Image.convert
    monkeypatch.setattr(Image.Image, "convert", lambda image, *a, **kw: decoded.append(1) or real(image, *a, **kw))
    from localllm.media import MAX_REQUEST_PIXELS

    side = 4096
    count = MAX_REQUEST_PIXELS // (side * side) + 1
    message = api.Message(role="user", content="what is this?", images=[_png(side, side)] * count)
    with pytest.raises(InvalidInput, match=f"{MAX_REQUEST_PIXELS:,}"):
        images.mark_messages([message])
    assert decoded == []


# ---------------------------------------------------------------------------------------------------------- messages


@pytest.mark.models
def test_more_messages_than_the_bound_are_a_400_naming_it(small_url):
    messages = [{"role": "user", "content": "hi"}] * (api.MAX_MESSAGES + 1)
    for path, body in (
        ("/api/chat", {"model": "smollm2:135m", "messages": messages, "stream": False}),
        ("/v1/chat/completions", {"model": "smollm2:135m", "messages": messages}),
        ("/v1/messages", {"model": "smollm2:135m", "max_tokens": 4, "messages": messages}),
    ):
        reply = httpx.post(small_url + path, json=body, timeout=DEADLINE)
        named = str(api.MAX_MESSAGES) in reply.text or f"{api.MAX_MESSAGES:,}" in reply.text
        assert reply.status_code == 400 and named, (path, reply.text[:300])


@pytest.mark.models
def test_a_chat_body_is_parsed_and_translated_off_the_event_loop(small_url, monkeypatch):
    """The translation of an OpenAI chat is held until /health has answered: on the event loop, /health could not."""
    from localllm.server.openai import requests as openai_requests

    answered, entered = threading.Event(), threading.Event()
    real = openai_requests.chat_messages

    def held(messages):
        entered.set()
        answered.wait(timeout=30)
        return real(messages)

    monkeypatch.setattr(openai_requests, "chat_messages", held)
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    chat = threading.Thread(target=httpx.post, args=(small_url + "/v1/chat/completions",), kwargs={"json": body})
    chat.start()
    try:
        assert entered.wait(timeout=DEADLINE)
        health = httpx.get(small_url + "/health", timeout=20)
        assert health.status_code == 200
        assert not answered.is_set()  # /health answered while the translation still waited
    finally:
        answered.set()
        chat.join(timeout=DEADLINE)
