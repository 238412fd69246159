"""The Ollama-native API, driven by the official `ollama` Python package against the real server and model."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import ollama
import pytest
from server_harness import SMALL, SYSTEM, private_home, served

from localllm import __version__

pytestmark = pytest.mark.models

PARIS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def api(base_url) -> ollama.Client:
    return ollama.Client(host=base_url)


def test_root_and_version(base_url, api):
    assert httpx.get(base_url + "/").text == "localllm is running"
    answer = api._client.get("/api/version").json()
    # Ollama's API version, which clients gate on (codex --oss refuses below 0.13.4); ours beside it
    assert tuple(map(int, answer["version"].split("."))) >= (0, 13, 4)
    assert answer["localllm"] == __version__


def test_chat_non_streaming_answers_paris(api):
    reply = api.chat(model="smollm2:135m", messages=PARIS, options={"temperature": 0, "num_predict": 24})
    assert "Paris" in reply.message.content
    assert reply.done and reply.done_reason in ("stop", "length")
    assert reply.prompt_eval_count > 0 and reply.eval_count > 0 and reply.total_duration > 0


def test_chat_streaming_matches_non_streaming(api):
    # Deterministic: the second request would otherwise reuse the first one's cached prompt, whose numerics differ.
    same = {"temperature": 0, "num_predict": 24, "deterministic": True}
    parts = list(api.chat(model="smollm2:135m", messages=PARIS, options=same, stream=True))
    whole = api.chat(model="smollm2:135m", messages=PARIS, options=same)
    assert len(parts) > 2
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_stream_lines_carry_timings_only_at_the_end(base_url):
    body = {"model": "smollm2:135m", "prompt": "Say hi", "options": SMALL}
    with httpx.stream("POST", base_url + "/api/generate", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [httpx.Response(200, content=line).json() for line in response.iter_lines() if line]
    assert all("eval_count" not in line for line in lines[:-1])
    assert {"total_duration", "load_duration", "prompt_eval_count", "eval_count", "eval_duration"} <= set(lines[-1])


def test_generate_streaming_and_not(api):
    same = {**SMALL, "deterministic": True}
    parts = list(api.generate(model="smollm2:135m", prompt="Count: one, two,", options=same, stream=True))
    whole = api.generate(model="smollm2:135m", prompt="Count: one, two,", options=same)
    assert "".join(p.response for p in parts) == whole.response
    assert whole.done_reason == "length" and whole.eval_count == SMALL["num_predict"]


def test_generate_returns_context_that_continues_the_conversation(api, base_url):
    first = api.generate(model="smollm2:135m", prompt="My name is Ada.", options=SMALL)
    assert first.context and all(isinstance(t, int) for t in first.context)
    # Ollama's context is the prompt as the model saw it and the answer: here, exactly its tokens.
    assert len(first.context) == first.prompt_eval_count + first.eval_count
    body = {
        "model": "smollm2:135m",
        "prompt": "What is my name?",
        "context": first.context,
        "options": SMALL,
        "stream": False,
    }
    second = httpx.post(base_url + "/api/generate", json=body, timeout=60).json()
    assert second["context"][: len(first.context)] == first.context
    assert second["prompt_eval_count"] > len(first.context)
    # The earlier turn is still in a slot's cache (the last answer token never entered it).
    assert second["prompt_cache_count"] >= len(first.context) - 1
    raw = api.generate(model="smollm2:135m", prompt="The sky is", raw=True, options=SMALL)
    assert raw.context is None


def test_generate_raw_and_json_format(api):
    raw = api.generate(model="smollm2:135m", prompt="The sky is", raw=True, options=SMALL)
    assert raw.response.strip()
    shaped = api.generate(
        model="smollm2:135m",
        prompt="Give a JSON object with a name.",
        format="json",
        options={"temperature": 0, "num_predict": 40},
    )
    assert shaped.response.lstrip().startswith("{")


def test_chat_format_schema_validates(api):
    schema = {
        "type": "object",
        "required": ["city"],
        "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 24}},
    }
    reply = api.chat(model="smollm2:135m", messages=PARIS, format=schema, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(reply.message.content), schema)


def test_embed_and_legacy_embeddings(api):
    result = api.embed(model="smollm2:135m", input=["hello", "bonjour"])
    assert len(result.embeddings) == 2 and len(result.embeddings[0]) > 10
    legacy = api.embeddings(model="smollm2:135m", prompt="hello")
    assert legacy.embedding == pytest.approx(result.embeddings[0], abs=1e-4)


def test_list_show_ps(api):
    api.generate(model="smollm2:135m", prompt="Hi", options=SMALL)
    names = [m.model for m in api.list().models]
    assert "smollm2:135m" in names
    shown = api.show("smollm2:135m")
    assert shown.details.family and shown.template
    running = api.ps().models
    assert [m.model for m in running] == ["smollm2:135m"]
    assert running[0].size > 0


def test_unknown_model_is_404_with_pull_hint(api):
    with pytest.raises(ollama.ResponseError) as info:
        api.chat(model="no-such-model:1b", messages=PARIS)
    assert info.value.status_code == 404
    assert "no-such-model" in info.value.error and "pull" in info.value.error


def test_context_overflow_is_400_with_numbers(api):
    long_prompt = "word " * 3000
    with pytest.raises(ollama.ResponseError) as info:
        api.generate(model="smollm2:135m", prompt=long_prompt, options=SMALL, stream=True).__next__()
    assert info.value.status_code == 400
    assert "1024" in info.value.error and "tokens" in info.value.error


def test_bad_field_is_400_naming_it(base_url):
    response = httpx.post(base_url + "/api/chat", json={"model": "smollm2:135m", "messages": [{"role": "robot"}]})
    assert response.status_code == 400
    assert "messages.0.role" in response.json()["error"]
    bad_option = httpx.post(
        base_url + "/api/generate", json={"model": "smollm2:135m", "prompt": "x", "options": {"top_p": 7}}
    )
    assert bad_option.status_code == 400 and "top_p" in bad_option.json()["error"]


def test_images_are_refused_clearly(api):
    """A model without a vision projector, in Ollama's words (tests/test_vision.py serves one that has one)."""
    with pytest.raises(ollama.ResponseError) as info:
        api.chat(model="smollm2:135m", messages=[{"role": "user", "content": "what is this?", "images": ["aGk="]}])
    assert info.value.status_code == 400
    assert "this model is missing data required for image input" in info.value.error


def test_body_without_json_content_type_is_read_as_json(base_url):
    # what `curl -d` sends
    response = httpx.post(
        base_url + "/api/show",
        content=b'{"model": "smollm2:135m"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 200 and response.json()["details"]["family"]


# Minutes of decoding on this machine, far more on a busy one: a slot freed within FREED_SECONDS was freed by the
# client leaving, not by the answer ending, however fast or loaded the machine is.
LONG = {"temperature": 0, "num_predict": 8000, "num_ctx": 8192, "ignore_eos": True}
FREED_SECONDS = 60


def _slots_busy(base_url: str) -> int:
    return sum(m["slots_busy"] for m in httpx.get(base_url + "/api/ps").json()["models"])


def _freed_within(base_url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _slots_busy(base_url):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_client_that_leaves_mid_stream_frees_its_slot(base_url):
    body = {"model": "smollm2:135m", "prompt": "Tell a long story.", "options": LONG}
    with httpx.stream("POST", base_url + "/api/generate", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines))["response"] is not None
        assert _slots_busy(base_url) == 1
    # The answer had most of its 8000 tokens to go; the slot is free at the engine's next steps instead.
    assert _freed_within(base_url, FREED_SECONDS)


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_slot(base_url):
    body = {"model": "smollm2:135m", "prompt": "Tell a long story.", "options": LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/api/generate", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert _freed_within(base_url, FREED_SECONDS)


def test_keep_alive_zero_unloads(api):
    api.generate(model="smollm2:135m", prompt="Hi", options=SMALL)
    assert api.ps().models
    answer = api.generate(model="smollm2:135m", keep_alive=0)
    assert answer.done_reason == "unload"
    assert api.ps().models == []


@pytest.fixture(scope="module")
def own_api(models_home, tmp_path_factory):
    """A server on a private home, for the tests that change the store."""
    home = private_home(models_home, tmp_path_factory.mktemp("own-home"))
    with served(home) as url:
        yield ollama.Client(host=url)


def test_pull_copy_delete_create(own_api):
    progress = list(own_api.pull("smollm2:135m", stream=True))
    assert progress[-1].status == "success"
    assert own_api.pull("smollm2:135m").status == "success"
    own_api.copy("smollm2:135m", "mine:copy")
    assert "mine:copy" in [m.model for m in own_api.list().models]
    own_api.delete("mine:copy")
    assert "mine:copy" not in [m.model for m in own_api.list().models]
    created = list(own_api.create(model="pirate:1", from_="smollm2:135m", system="Talk like a pirate.", stream=True))
    assert created[-1].status == "success"
    shown = own_api._client.post("/api/show", json={"model": "pirate:1"}).json()
    assert shown["system"] == "Talk like a pirate."
    with pytest.raises(ollama.ResponseError) as info:
        own_api.delete("never-was:1")
    assert info.value.status_code == 404
