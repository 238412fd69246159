"""Requests that need a reload or a model switch wait their turn, as Ollama's scheduler makes them wait, never 503
for it; a batch the queue could never hold is a 400; a planted disk cache never holds a request (issue 48). The
real server on loopback over the catalog models; every wait is bounded by a deadline far above the work, never
timed."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from localllm import config
from localllm.engine import prefix_cache
from localllm.engine.prefix_cache import MAGIC, encode_state
from tests.server_harness import env, local_client, private_home, serve_in_thread, with_pinned_model

pytestmark = pytest.mark.models

DEADLINE = 120.0  # seconds: far above any request here
MODEL = "smollm2:135m"
ISSUE_REQUEST = {  # the request of issue 48, verbatim
    "model": MODEL,
    "max_tokens": 10,
    "messages": [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Write an example"},
    ],
    "response_format": {"type": "json_object"},
}


@contextmanager
def _server(home: Path, **settings: str) -> Iterator[tuple[str, object]]:
    """The real app over a LocalClient on `home`: (its URL, the client, whose pool the test may read)."""
    from localllm.server.app import create_app

    with env(LOCALLLM_NUM_THREAD="1", **settings):
        client = local_client(home)
        try:
            with serve_in_thread(create_app(client)) as url:
                yield url, client
        finally:
            client.close()


def _chat(model: str, text: str, **options) -> dict:
    return {
        "model": model,
        "stream": False,
        "messages": [{"role": "user", "content": text}],
        "options": {"temperature": 0, "num_predict": 6, **options},
    }


@pytest.fixture(scope="module")
def home(models_home, tmp_path_factory) -> Path:
    return with_pinned_model(private_home(models_home, tmp_path_factory.mktemp("queue") / "home"))


def _long_stream(http: httpx.Client, url: str, **options):
    """A chat that generates until the test closes it: (its response, once the first chunk has come)."""
    body = _chat(MODEL, "Count from one to a thousand.", ignore_eos=True, num_predict=-1, **options) | {"stream": True}
    request = http.build_request("POST", url + "/api/chat", json=body)
    response = http.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()  # kept with the response: a dropped iterator would close the connection
    assert json.loads(next(lines))["done"] is False
    response.lines = lines  # type: ignore[attr-defined]
    return response


def _poll(url: str, until, what: str) -> dict:
    """/api/ps until `until(ps)`; fails after the deadline."""
    import time

    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        ps = httpx.get(url + "/api/ps", timeout=DEADLINE).json()
        if until(ps):
            return ps
        time.sleep(0.05)
    pytest.fail(f"{what}: /api/ps never showed it: {ps}")


def test_a_request_with_other_load_options_waits_for_the_running_one_then_answers(home):
    with _server(home) as (url, _), httpx.Client(timeout=DEADLINE) as http:
        first = _long_stream(http, url, num_ctx=2048)
        answer: dict = {}
        waiter = threading.Thread(
            target=lambda: answer.update(r=httpx.post(url + "/api/chat", json=_chat(MODEL, "Hi"), timeout=DEADLINE))
        )
        waiter.start()
        ps = _poll(url, lambda ps: ps.get("load_queue") == 1, "a request waiting for the reload")
        (row,) = ps["models"]
        assert row["status"] == "draining" and row["load_waiting"] == 1
        metrics = httpx.get(url + "/metrics").text
        assert "localllm_load_queue_depth 1.0" in metrics
        assert f'localllm_model_draining{{model="{MODEL}"}} 1.0' in metrics
        assert waiter.is_alive()  # it waits while the first one runs: no 503
        first.close()  # the running request ends (its client leaves)
        waiter.join(DEADLINE)
        assert not waiter.is_alive()
        response = answer["r"]
        assert response.status_code == 200, response.text
        assert response.json()["message"]["content"]
        (row,) = httpx.get(url + "/api/ps").json()["models"]
        assert row["context_length"] != 2048 and row.get("status") is None


def test_same_option_requests_arriving_behind_a_waiting_reload_wait_their_turn(home):
    # No option set starves: once a request with other options waits, the model takes no new ones of the old.
    with _server(home) as (url, _), httpx.Client(timeout=DEADLINE) as http:
        first = _long_stream(http, url, num_ctx=2048)
        answers: list[tuple[str, httpx.Response]] = []

        def ask(name: str, **options) -> None:
            body = _chat(MODEL, "Hi", **options)
            answers.append((name, httpx.post(url + "/api/chat", json=body, timeout=DEADLINE)))

        other = threading.Thread(target=ask, args=("default",))
        other.start()
        _poll(url, lambda ps: ps.get("load_queue") == 1, "the reload waiting")
        same = threading.Thread(target=ask, args=("2048",), kwargs={"num_ctx": 2048})
        same.start()
        # queued behind it, not served by the draining model
        _poll(url, lambda ps: ps.get("load_queue") == 2, "the same-option request queued behind it")
        first.close()
        for thread in (other, same):
            thread.join(DEADLINE)
        # the reloaded model (the default, larger context) serves both
        assert sorted((name, r.status_code) for name, r in answers) == [("2048", 200), ("default", 200)]


@pytest.mark.parametrize("models", [2, 3])
def test_chats_over_more_models_than_may_be_loaded_all_answer(home, models):
    names = [MODEL, "gemma3:270m", "pinned:1"][:models]
    with _server(home, LOCALLLM_MAX_LOADED_MODELS="1") as (url, _):
        results: list[int] = []

        def ask(model: str, i: int) -> None:
            response = httpx.post(url + "/api/chat", json=_chat(model, f"Say {i}."), timeout=DEADLINE)
            results.append(response.status_code)

        threads = [threading.Thread(target=ask, args=(names[i % models], i)) for i in range(2 * models)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE)
        assert results == [200] * len(threads)
        assert len(httpx.get(url + "/api/ps").json()["models"]) == 1


def test_a_full_load_queue_is_still_an_immediate_503(home):
    with _server(home, LOCALLLM_MAX_QUEUE="1") as (url, _), httpx.Client(timeout=DEADLINE) as http:
        first = _long_stream(http, url, num_ctx=2048)
        waiter = threading.Thread(
            target=lambda: httpx.post(url + "/api/chat", json=_chat(MODEL, "Hi"), timeout=DEADLINE)
        )
        waiter.start()
        _poll(url, lambda ps: ps.get("load_queue") == 1, "one request waiting")
        refused = httpx.post(url + "/api/chat", json=_chat(MODEL, "Hello", num_ctx=1024), timeout=DEADLINE)
        first.close()
        waiter.join(DEADLINE)
    assert refused.status_code == 503 and refused.headers.get("retry-after")
    assert "LOCALLLM_MAX_QUEUE" in refused.json()["error"]


def test_a_wait_past_the_load_timeout_is_a_clear_error(home):
    with _server(home, LOCALLLM_LOAD_TIMEOUT="1") as (url, _), httpx.Client(timeout=DEADLINE) as http:
        first = _long_stream(http, url, num_ctx=2048)
        late = httpx.post(url + "/api/chat", json=_chat(MODEL, "Hi"), timeout=DEADLINE)
        first.close()
    assert late.status_code == 503
    error = late.json()["error"]
    assert "waited 1s" in error and "LOCALLLM_LOAD_TIMEOUT" in error and MODEL in error


def test_n_beyond_the_slots_and_queue_is_a_400_naming_the_bound(home):
    with _server(home) as (url, _):
        body = {"model": MODEL, "n": 128, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=DEADLINE)
    assert response.status_code == 400, response.text
    assert all(bound in response.text for bound in ("128", "4 slots", "a queue of 64", "LOCALLLM_MAX_QUEUE"))


# ----------------------------------------------------------------------------------------------- planted cache


@pytest.fixture(scope="module")
def long_state(home) -> tuple[list[int], bytes]:
    """The tokens and state a server with 4,096 tokens per slot leaves on disk after a long conversation with the
    issue's system prompt."""
    before = set(config.prefix_cache_dir().rglob("*.kv"))
    with _server(home) as (url, _):
        body = ISSUE_REQUEST | {"max_tokens": 2}
        body["messages"] = [body["messages"][0], {"role": "user", "content": "Explain " + "these words " * 300}]
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=DEADLINE).status_code == 200
    (path,) = set(config.prefix_cache_dir().rglob("*.kv")) - before  # its unload wrote the slot's state
    raw = path.read_bytes()
    path.unlink()
    return _parts(raw)


def _parts(raw: bytes) -> tuple[list[int], bytes]:
    start = len(MAGIC) + 4
    length = int.from_bytes(raw[len(MAGIC) : start], "little")
    header = json.loads(raw[start : start + length])
    end = start + length + 4 * header["n_tokens"]
    tokens = [int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(start + length, end, 4)]
    return tokens, raw[end:]


def _plant(client, state: tuple[list[int], bytes]) -> Path | None:
    """Write `state` into the disk tier of the model `client` has loaded, signed for its load (as a home copied
    from a server with a longer context would hold it); then unload, so the next load scans it."""
    (entry,) = client.pool.entries()
    disk = entry.engine.prefix_cache.disk if entry.engine.prefix_cache is not None else None
    client.pool.unload(entry.model.digest)
    if disk is None:
        return None
    tokens, data = state
    disk.folder.mkdir(parents=True, exist_ok=True)
    path = disk.folder / ("f" * 32 + ".kv")
    path.write_bytes(b"".join(encode_state(disk.digest, disk.fingerprint, prefix_cache.as_tokens(tokens), 0, data)))
    return path


def _load(url: str) -> None:
    assert httpx.post(url + "/api/generate", json={"model": MODEL}, timeout=DEADLINE).status_code == 200


def test_a_planted_cache_longer_than_the_context_never_holds_the_issues_request(home, long_state):
    settings = {"LOCALLLM_CONTEXT_LENGTH": "256", "LOCALLLM_NUM_PARALLEL": "4"}
    with _server(home, **settings) as (url, client):
        _load(url)
        planted = _plant(client, long_state)
        assert planted is not None
        for _ in range(2):  # the first request after the restart, and the next
            response = httpx.post(url + "/v1/chat/completions", json=ISSUE_REQUEST, timeout=DEADLINE)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"]


# ----------------------------------------------------------------------------------------------- every combination

COMBINATIONS = [
    (slots, pool, cache)
    for slots in (1, 4)
    for pool in ("unified", "per slot")
    for cache in ("off", "on", "planted")
    if not (slots == 1 and pool == "per slot")  # one slot: the pool is its context either way
]


@pytest.mark.slow
@pytest.mark.parametrize(("slots", "pool", "cache"), COMBINATIONS)
def test_every_request_finishes_or_fails_clearly_within_a_bound(home, long_state, slots, pool, cache):
    settings = {"LOCALLLM_CONTEXT_LENGTH": "256", "LOCALLLM_NUM_PARALLEL": str(slots)}
    if pool == "per slot":
        settings["LOCALLLM_KV_POOL"] = str(256 * slots)
    if cache == "off":
        settings |= {"LOCALLLM_CACHE_RAM": "0", "LOCALLLM_CACHE_DISK": "0"}
    with _server(home, **settings) as (url, client):
        if cache == "planted":
            _load(url)
            _plant(client, long_state)
        system = ISSUE_REQUEST["messages"][0]
        bodies = [ISSUE_REQUEST]
        for i in range(4):  # prompts from a few tokens to most of the context, sharing the system prompt
            body = _chat(MODEL, "Describe " + "the sea " * (5 + 20 * i))
            bodies.append(body | {"messages": [system, *body["messages"]]})
        bodies.append(_chat(MODEL, "Hi", num_ctx=512))  # another load option, while the others run
        statuses: list[tuple[int, str]] = []

        def ask(body: dict) -> None:
            route = "/v1/chat/completions" if "max_tokens" in body else "/api/chat"
            response = httpx.post(url + route, json=body, timeout=DEADLINE)
            statuses.append((response.status_code, response.text[:200]))

        for _round in range(2):  # the second round meets what the first left in the slots and the cache
            threads = [threading.Thread(target=ask, args=(body,)) for body in bodies]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(DEADLINE)
            assert not any(thread.is_alive() for thread in threads)
    assert [status for status, _ in statuses] == [200] * len(statuses), statuses
