"""HttpClient against the real server: the Client Protocol over HTTP, errors mapped back to errors.* classes, and a
closed stream that frees its slot on the server."""

from __future__ import annotations

import time

import httpx
import pytest
from server_harness import SMALL, SYSTEM, env, free_port, local_client, private_home, serve_in_thread

from localllm import __version__, api
from localllm.client.http import HttpClient, server_running
from localllm.errors import InvalidInput, ModelNotFound, ServerUnreachable, Unauthorized
from localllm.server.app import create_app

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def served(models_home, tmp_path_factory):
    """(base URL, the LocalClient behind it). One slot and a queue of one, so a slot that is not freed shows."""
    home = private_home(models_home, tmp_path_factory.mktemp("http-home"))
    with env(LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="1", LOCALLLM_MAX_QUEUE="1"):
        client = local_client(home)
        try:
            with serve_in_thread(create_app(client)) as url:
                yield url, client
        finally:
            client.close()


@pytest.fixture
def base_url(served):
    return served[0]


@pytest.fixture
def http(base_url):
    with HttpClient(base_url) as client:
        yield client


def chat_request(**fields) -> api.ChatRequest:
    messages = [
        api.Message(role="system", content=SYSTEM),
        api.Message(role="user", content="What is the capital of France?"),
    ]
    return api.ChatRequest(**{"model": "smollm2:135m", "messages": messages, "options": SMALL, **fields})


def test_server_running(base_url):
    assert server_running(base_url)
    assert not server_running(f"http://127.0.0.1:{free_port()}")


def test_models_api(http):
    assert http.version() == __version__  # ours, not the Ollama API version the route claims
    assert "smollm2:135m" in [m.name for m in http.list_models().models]
    assert http.show("smollm2:135m").details.family == "llama"
    assert [p.status for p in http.pull("smollm2:135m")][-1] == "success"
    http.copy("smollm2:135m", "copied:1")
    assert "copied:1" in [m.name for m in http.list_models().models]
    http.delete("copied:1")
    assert "copied:1" not in [m.name for m in http.list_models().models]
    created = list(http.create(api.CreateRequest(model="terse:1", from_="smollm2:135m", system="Be terse.")))
    assert created[-1].status == "success" and http.show("terse:1").system == "Be terse."


def test_chat_generate_embed_ps_stop(http):
    chunks = list(http.chat(chat_request(options={"temperature": 0, "num_predict": 24})))
    assert chunks[-1].done and "Paris" in "".join(c.message.content for c in chunks)
    assert chunks[-1].eval_count > 0
    story = api.GenerateRequest(model="smollm2:135m", prompt="Tell me a long story about a dragon.", options=SMALL)
    generated = list(http.generate(story))
    assert generated[-1].done_reason == "length" and generated[-1].eval_count == SMALL["num_predict"]
    assert all(isinstance(c, api.GenerateChunk) for c in generated)
    vectors = http.embed(api.EmbedRequest(model="smollm2:135m", input=["a", "b"])).embeddings
    assert len(vectors) == 2
    assert [m.name for m in http.ps().models] == ["smollm2:135m"]
    http.stop("smollm2:135m")
    assert http.ps().models == []


def test_errors_come_back_as_their_classes(http):
    with pytest.raises(ModelNotFound, match="pull"):
        list(http.chat(chat_request(model="missing:7b")))
    with pytest.raises(InvalidInput, match="1024"):
        list(http.generate(api.GenerateRequest(model="smollm2:135m", prompt="word " * 3000, options=SMALL)))
    with pytest.raises(InvalidInput, match="top_p"):
        list(http.generate(api.GenerateRequest(model="smollm2:135m", prompt="x", options={"top_p": 7})))


def test_unreachable_server_names_the_address():
    url = f"http://127.0.0.1:{free_port()}"
    with HttpClient(url) as client, pytest.raises(ServerUnreachable) as info:
        client.list_models()
    assert url in str(info.value) and "localllm serve" in str(info.value)


def test_closing_a_stream_frees_the_slot(http, served):
    stream = http.generate(
        api.GenerateRequest(
            model="smollm2:135m",
            prompt="Tell a long story.",
            options={"temperature": 0, "num_predict": 900, "ignore_eos": True},
        )
    )
    first = [next(stream), next(stream)]
    assert not first[-1].done
    engine = served[1].pool.entries()[0].engine
    before = engine.snapshot().generated_tokens
    stream.close()
    wait_until_idle(http)
    # The abandoned request was cancelled, not run to its 900 tokens, and the only slot serves the next one.
    assert engine.snapshot().generated_tokens - before < 900
    answer = list(http.generate(api.GenerateRequest(model="smollm2:135m", prompt="Hi", options=SMALL)))
    assert answer[-1].done and answer[-1].done_reason in ("stop", "length")


def test_a_client_leaving_a_non_streamed_request_cancels_it(http, served):
    list(http.generate(api.GenerateRequest(model="smollm2:135m", prompt="Hi", options=SMALL)))
    engine = served[1].pool.entries()[0].engine
    before = engine.snapshot().generated_tokens
    body = {
        "model": "smollm2:135m",
        "prompt": "Tell a long story.",
        "stream": False,
        "options": {"temperature": 0, "num_predict": 900, "ignore_eos": True},
    }
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 900 tokens could be ready
        httpx.post(served[0] + "/api/generate", json=body, timeout=httpx.Timeout(10, read=1.0))
    wait_until_idle(http, limit=120)
    assert engine.snapshot().generated_tokens - before < 900


def test_api_key(models_home):
    with env(LOCALLLM_API_KEY="s3cret"):
        app = create_app(local_client(models_home))
    with serve_in_thread(app) as url:
        with HttpClient(url, api_key="") as anonymous, pytest.raises(Unauthorized):
            anonymous.list_models()
        with HttpClient(url, api_key="s3cret") as keyed:
            assert keyed.list_models().models


def wait_until_idle(http: HttpClient, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while any(m.slots_busy or m.queue_depth for m in http.ps().models):
        assert time.monotonic() < deadline, "the slot was never freed"
        time.sleep(0.05)


def test_the_memory_plan_over_the_api_equals_the_local_one(served, http):
    _, local = served
    asked = api.PlanRequest(model="smollm2:135m", options={"num_ctx": 2048, "num_parallel": 2})
    remote = http.plan(asked)
    # the same plan, less what follows the machine's free memory from one moment to the next
    moving = {"available", "fits", "cache_ram_limit", "cache_disk_limit", "placement"}
    assert [m.model_dump(exclude=moving) for m in remote.models] == [
        m.model_dump(exclude=moving) for m in local.plan(asked).models
    ]
    (row,) = remote.models
    assert (row.num_ctx, row.num_parallel) == (2048, 2)
    assert row.total == row.weights + row.adapters + row.projector + row.kv_total + row.compute
    assert remote.total == row.total and row.placement is not None and row.placement.devices[0].kind == "cpu"
    with pytest.raises(InvalidInput, match="num_ctx"):
        http.plan(api.PlanRequest(model="smollm2:135m", options={"num_ctx": "many"}))
    with pytest.raises(ModelNotFound):
        http.plan(api.PlanRequest(model="nothing-here:1b"))
