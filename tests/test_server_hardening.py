"""Requests that used to crash, hang or poison the server (issue 13), each against the real server on loopback with
the real model. After every case the server still answers a plain request."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from localllm.client.http import HttpClient
from localllm.errors import InvalidInput
from localllm.server.app import create_app
from server_harness import env, local_client, private_home, serve_in_thread

pytestmark = pytest.mark.models

MODEL = "smollm2:135m"
QUICK = {"temperature": 0, "num_predict": 2}


@pytest.fixture(scope="module")
def home(models_home, tmp_path_factory):
    return private_home(models_home, tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def base_url(home):
    with env(LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2", LOCALLLM_HOME=str(home)):
        client = local_client(home)
        try:
            with serve_in_thread(create_app(client)) as url:
                yield url
        finally:
            client.close()


def generate(url: str, **body) -> httpx.Response:
    # json.dumps rather than httpx's json=, which refuses the NaN some cases send (Python's json reads it)
    content = json.dumps({"model": MODEL, "prompt": "Say hi", "stream": False, "options": QUICK, **body})
    return httpx.post(url + "/api/generate", content=content, headers={"content-type": "application/json"},
                      timeout=120)


def assert_still_answers(url: str) -> None:
    plain = generate(url)
    assert plain.status_code == 200 and plain.json()["done"], plain.text


def error_of(response: httpx.Response) -> str:
    return response.json()["error"]


# ---------------------------------------------------------------------------------------------------------- options

@pytest.mark.parametrize("options, named", [
    ({"num_ctx": 2**30}, ["num_ctx 1073741824", "8192"]),  # wrapped in a 32-bit field before
    ({"num_ctx": 99999999}, ["num_ctx 99999999", "8192"]),  # allocated without end before
    ({"repeat_last_n": 2**30, "repeat_penalty": 1.1}, ["repeat_last_n 1073741824", "1024"]),  # std::bad_alloc abort
    ({"num_thread": (os.cpu_count() or 1) + 1}, ["num_thread", "cores"]),
    ({"top_k": 10**6}, ["top_k 1000000", "vocabulary"]),
    ({"num_predict": 10**12}, ["num_predict", "2147483647"]),
    ({"temperature": float("nan")}, ["temperature", "finite"]),
])
def test_options_out_of_bounds_are_400_naming_value_and_bound(base_url, options, named):
    refused = generate(base_url, options={**QUICK, **options})
    assert refused.status_code == 400, refused.text
    assert all(part in error_of(refused) for part in named), error_of(refused)
    assert_still_answers(base_url)


def test_context_larger_than_memory_is_400_with_the_plan(base_url):
    # gemma3:270m is trained on 32768 tokens; 256 slots of that need about 150 GiB of KV cache.
    refused = generate(base_url, model="gemma3:270m", options={**QUICK, "num_ctx": 32768, "num_parallel": 256})
    assert refused.status_code == 400, refused.text
    assert "num_parallel 256" in error_of(refused) and "localllm plan" in error_of(refused)
    assert_still_answers(base_url)


def test_chat_set_parameter_path_gets_the_same_bounds(base_url):
    # The chat's `/set parameter num_ctx 99999999` becomes the options of its next request through the client.
    from localllm import api

    value = api.parse_option("num_ctx", "99999999")
    with HttpClient(base_url) as client:
        with pytest.raises(InvalidInput, match="num_ctx 99999999"):
            list(client.chat(api.ChatRequest(model=MODEL, messages=[api.Message(role="user", content="hi")],
                                             options={"num_ctx": value})))
    assert_still_answers(base_url)


# ---------------------------------------------------------------------------------------------------------- keep_alive

@pytest.mark.parametrize("keep_alive", [1e12, "999999999h", 10**400])
def test_huge_keep_alive_means_forever_and_never_poisons_the_model(base_url, keep_alive):
    answered = generate(base_url, keep_alive=keep_alive)
    assert answered.status_code == 200, answered.text
    row = next(m for m in httpx.get(base_url + "/api/ps").json()["models"] if m["name"] == MODEL)
    assert row.get("expires_at") is None  # forever
    assert_still_answers(base_url)
    assert generate(base_url, keep_alive="5m").status_code == 200


def test_nan_keep_alive_is_400(base_url):
    refused = generate(base_url, keep_alive=float("nan"))
    assert refused.status_code == 400 and "keep_alive" in error_of(refused)
    assert_still_answers(base_url)


# ---------------------------------------------------------------------------------------------------------- statuses

@pytest.mark.parametrize("path, body", [
    ("/api/embed", {"input": ""}), ("/api/embed", {"input": [""]}), ("/api/embeddings", {"prompt": ""}),
    ("/v1/embeddings", {"input": ""}), ("/v1/embeddings", {"input": [""]}),
])
def test_empty_embedding_input_is_not_a_server_error(base_url, path, body):
    answered = httpx.post(base_url + path, json={"model": MODEL, **body}, timeout=120)
    assert answered.status_code < 500, answered.text
    assert_still_answers(base_url)


@pytest.mark.parametrize("body, words", [
    ({"template": "{% if false %}x{% endif %}"}, "empty after templating"),
    ({"template": "{{ 1 / 0 }}"}, "template"),
    ({"template": "{% for i in range(1000000) %}{% endfor %}"}, "range"),
    ({"model": "smol\u0000lm2:135m"}, "control character"),
    ({"model": "/tmp/a\u0000b.gguf"}, "control character"),
    ({"context": [2**40, -1]}, "token id"),
])
def test_bad_input_is_400_with_its_own_message(base_url, body, words):
    refused = generate(base_url, **body)
    assert refused.status_code == 400, refused.text
    assert words in error_of(refused)
    assert_still_answers(base_url)
