"""Requests that used to crash, hang or poison the server (issue 13), each against the real server on loopback with
the real model. After every case the server still answers a plain request."""

from __future__ import annotations

import json
import os
import select
import socket
import time

import httpx
import pytest
from server_harness import private_home, served

from localllm.client.http import HttpClient
from localllm.errors import InvalidInput

pytestmark = pytest.mark.models

MODEL = "smollm2:135m"
QUICK = {"temperature": 0, "num_predict": 2}


@pytest.fixture(scope="module")
def home(models_home, tmp_path_factory):
    return private_home(models_home, tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def base_url(home):
    with served(home, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2", LOCALLLM_HOME=str(home)) as url:
        yield url


def generate(url: str, **body) -> httpx.Response:
    # json.dumps rather than httpx's json=, which refuses the NaN some cases send (Python's json reads it)
    content = json.dumps({"model": MODEL, "prompt": "Say hi", "stream": False, "options": QUICK, **body})
    return httpx.post(url + "/api/generate", content=content, headers={"content-type": "application/json"}, timeout=120)


def assert_still_answers(url: str) -> None:
    plain = generate(url)
    assert plain.status_code == 200 and plain.json()["done"], plain.text


def error_of(response: httpx.Response) -> str:
    return response.json()["error"]


# ---------------------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "options, named",
    [
        ({"num_ctx": 2**30}, ["num_ctx 1073741824", "8192"]),  # wrapped in a 32-bit field before
        ({"num_ctx": 99999999}, ["num_ctx 99999999", "8192"]),  # allocated without end before
        ({"repeat_last_n": 2**30, "repeat_penalty": 1.1}, ["repeat_last_n 1073741824", "1024"]),  # std::bad_alloc abort
        ({"num_thread": (os.cpu_count() or 1) + 1}, ["num_thread", "cores"]),
        ({"top_k": 10**6}, ["top_k 1000000", "vocabulary"]),
        ({"num_predict": 10**12}, ["num_predict", "2147483647"]),
        ({"temperature": float("nan")}, ["temperature", "finite"]),
    ],
)
def test_options_out_of_bounds_are_400_naming_value_and_bound(base_url, options, named):
    refused = generate(base_url, options={**QUICK, **options})
    assert refused.status_code == 400, refused.text
    assert all(part in error_of(refused) for part in named), error_of(refused)
    assert_still_answers(base_url)


def test_context_larger_than_memory_is_400_with_the_plan(base_url, monkeypatch):
    # gemma3:270m is trained on 32768 tokens; 256 slots of that, each with cells of its own (a pool as large as all
    # of them), need about 150 GiB of KV cache. (The server runs in this process: the load reads this setting.)
    monkeypatch.setenv("LOCALLLM_KV_POOL", str(32768 * 256))
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
            list(
                client.chat(
                    api.ChatRequest(
                        model=MODEL, messages=[api.Message(role="user", content="hi")], options={"num_ctx": value}
                    )
                )
            )
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


@pytest.mark.parametrize(
    "path, body",
    [
        ("/api/embed", {"input": ""}),
        ("/api/embed", {"input": [""]}),
        ("/api/embeddings", {"prompt": ""}),
        ("/v1/embeddings", {"input": ""}),
        ("/v1/embeddings", {"input": [""]}),
    ],
)
def test_empty_embedding_input_is_not_a_server_error(base_url, path, body):
    answered = httpx.post(base_url + path, json={"model": MODEL, **body}, timeout=120)
    assert answered.status_code < 500, answered.text
    assert_still_answers(base_url)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"template": "{% if false %}x{% endif %}"}, "empty after templating"),
        ({"template": "{{ 1 / 0 }}"}, "template"),
        ({"template": "{% for i in range(1000000) %}{% endfor %}"}, "range"),
        ({"model": "smol\u0000lm2:135m"}, "control character"),
        ({"model": "/tmp/a\u0000b.gguf"}, "control character"),
        ({"context": [2**40, -1]}, "token id"),
    ],
)
def test_bad_input_is_400_with_its_own_message(base_url, body, words):
    refused = generate(base_url, **body)
    assert refused.status_code == 400, refused.text
    assert words in error_of(refused)
    assert_still_answers(base_url)


# ---------------------------------------------------------------------------------------------------------- queue


def open_request(url: str, body: dict) -> socket.socket:
    """Send a request on a raw socket and leave it waiting, so the test decides when the client goes away."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return sock


def queue_depth(url: str) -> int:
    return sum(m["queue_depth"] for m in httpx.get(url + "/api/ps").json()["models"])


def wait_for(condition, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def status_line(sock: socket.socket) -> bytes:
    sock.settimeout(120)
    return sock.makefile("rb").readline()


def test_queued_clients_that_leave_give_their_places_back(home):
    long = {
        "model": MODEL,
        "prompt": "Count to a million",
        "stream": True,
        "options": {"temperature": 0, "num_predict": 4000, "ignore_eos": True},
    }
    with served(
        home, LOCALLLM_NUM_PARALLEL="2", LOCALLLM_MAX_QUEUE="4", LOCALLLM_CONTEXT_LENGTH="4096", LOCALLLM_HOME=str(home)
    ) as url:
        holders = [open_request(url, long) for _ in range(2)]
        assert all(status_line(s).startswith(b"HTTP/1.1 200") for s in holders)  # both slots busy
        queued = [open_request(url, {**long, "stream": False}) for _ in range(4)]
        assert wait_for(lambda: queue_depth(url) == 4)
        for sock in queued:  # the four clients give up
            sock.close()
        assert wait_for(lambda: queue_depth(url) == 0), "clients that left are still queued"
        fresh = open_request(url, {"model": MODEL, "prompt": "Say hi", "stream": False, "options": QUICK})
        assert wait_for(lambda: queue_depth(url) == 1 or select.select([fresh], [], [], 0)[0])
        for sock in holders:
            sock.close()
        assert status_line(fresh).startswith(b"HTTP/1.1 200")
        fresh.close()


# ---------------------------------------------------------------------------------------------------------- templates

BOMBS = ["{{ 'a' * 400000000 }}", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"]


@pytest.mark.parametrize("bomb", BOMBS)
def test_costly_request_template_is_a_fast_400(base_url, bomb):
    refused = generate(base_url, template=bomb)
    assert refused.status_code == 400 and "the chat template was stopped" in error_of(refused)
    assert_still_answers(base_url)


def test_costly_modelfile_template_is_a_400_at_use(base_url):
    created = httpx.post(
        base_url + "/api/create",
        json={"model": "bomb", "from": MODEL, "template": BOMBS[1], "stream": False},
        timeout=120,
    )
    assert created.status_code == 200, created.text
    refused = httpx.post(
        base_url + "/api/chat",
        json={"model": "bomb", "stream": False, "options": QUICK, "messages": [{"role": "user", "content": "hi"}]},
        timeout=120,
    )
    assert refused.status_code == 400 and "steps" in error_of(refused)
    assert_still_answers(base_url)


# ---------------------------------------------------------------------------------------------------------- names


def read_stream_end(sock: socket.socket) -> dict:
    """Read an NDJSON stream (after its status line) to its last line; chunked framing lines are skipped."""
    last: dict = {}
    for line in sock.makefile("rb"):
        if line.startswith(b"{"):
            last = json.loads(line)
            if last.get("done") or "error" in last:
                return last
    return last


def loaded_names(url: str) -> list[str]:
    return [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]]


RUNNING = {"temperature": 0, "num_predict": 150, "ignore_eos": True}


def test_deleting_an_alias_never_cuts_off_the_original(base_url):
    assert httpx.post(base_url + "/api/copy", json={"source": MODEL, "destination": "alias:1"}).status_code == 200
    sock = open_request(base_url, {"model": MODEL, "prompt": "Count", "options": RUNNING})
    assert status_line(sock).startswith(b"HTTP/1.1 200")
    deleted = httpx.request("DELETE", base_url + "/api/delete", json={"model": "alias:1"})
    assert deleted.status_code == 200
    end = read_stream_end(sock)
    sock.close()
    assert end.get("done_reason") == "length" and end.get("eval_count") == 150, end
    assert any(name.startswith("smollm2") for name in loaded_names(base_url))
    assert_still_answers(base_url)


def test_deleting_the_last_name_unloads_after_its_requests_end(base_url):
    created = httpx.post(
        base_url + "/api/create",
        json={"model": "solo", "from": MODEL, "system": "Be brief.", "stream": False},
        timeout=120,
    )
    assert created.status_code == 200, created.text
    sock = open_request(base_url, {"model": "solo", "prompt": "Count", "options": RUNNING})
    assert status_line(sock).startswith(b"HTTP/1.1 200")
    assert httpx.request("DELETE", base_url + "/api/delete", json={"model": "solo"}).status_code == 200
    end = read_stream_end(sock)
    sock.close()
    assert end.get("done_reason") == "length", end
    assert wait_for(lambda: not any(name.startswith("solo") for name in loaded_names(base_url)))
    assert_still_answers(base_url)


def test_unloading_under_a_non_streamed_request_is_499_not_500(base_url):
    # As long as the context allows: the unload cuts it off within a second or so, however fast the machine.
    sock = open_request(
        base_url, {"model": MODEL, "prompt": "Count", "stream": False, "options": {**RUNNING, "num_predict": 1000}}
    )
    assert wait_for(lambda: sum(m["slots_busy"] for m in httpx.get(base_url + "/api/ps").json()["models"]) > 0)
    unloaded = generate(base_url, prompt="", keep_alive=0)
    assert unloaded.status_code == 200 and unloaded.json()["done_reason"] == "unload"
    reply = sock.makefile("rb").read().decode()
    sock.close()
    assert reply.startswith("HTTP/1.1 499") and "unloaded" in reply, reply[:300]
    assert_still_answers(base_url)
