"""The client contract (issue 16): request shapes that real Ollama and OpenAI clients send, answered as those
servers answer them. The real `ollama` and `openai` packages send what they can; the rest are raw bodies shaped as
langchain-ollama, llama-index-llms-ollama, langchain-openai and litellm send them (read from their sources)."""

from __future__ import annotations

import hashlib
import json
import logging
import math

import httpx
import ollama
import openai
import pytest
from server_harness import PINNED, SYSTEM, env, local_client, pinned_server, private_home, served

from localllm.server.openai.requests import ChatCompletionRequest, chat_requests

pytestmark = pytest.mark.models

MODEL = "smollm2:135m"
SMALL = {"temperature": 0, "num_predict": 8}
HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def base_url(models_home, tmp_path_factory):
    target = tmp_path_factory.mktemp("contract")
    with pinned_server(models_home, target, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="3") as url:
        yield url


@pytest.fixture(scope="module")
def api(base_url) -> ollama.Client:
    return ollama.Client(host=base_url)


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=120)


# ---------------------------------------------------------------------------------------------------------- Ollama


def test_null_and_obsolete_options_are_skipped_with_a_warning(api, base_url, caplog):
    # langchain-ollama's OllamaEmbeddings sends every option it knows, unset ones as null (its _default_params).
    langchain_embed = {
        "mirostat": None,
        "mirostat_eta": None,
        "mirostat_tau": None,
        "num_ctx": None,
        "num_gpu": None,
        "num_thread": None,
        "repeat_last_n": None,
        "repeat_penalty": None,
        "temperature": None,
        "stop": None,
        "tfs_z": None,
        "top_k": None,
        "top_p": None,
    }
    assert len(api.embed(model=MODEL, input=["hello"], options=langchain_embed).embeddings[0]) > 10
    # Options Ollama dropped long ago, which old clients still send: ignored and logged, as Ollama does.
    with caplog.at_level(logging.WARNING, logger="localllm.api"):
        reply = api.chat(
            model=MODEL,
            messages=HI,
            options={**SMALL, "f16_kv": True, "logits_all": False, "rope_frequency_base": 10000.0, "vocab_only": None},
        )
    assert reply.done and reply.eval_count > 0
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "f16_kv" in warned and "logits_all" in warned and "rope_frequency_base" in warned
    # llama-index-llms-ollama's chat(): stream false, format "", tools null, options with an unset context window,
    # keep_alive null. Every call of it failed on the null.
    llama_index = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi"}],
        "stream": False,
        "format": "",
        "tools": None,
        "options": {"temperature": 0.75, "num_ctx": None, "num_predict": 8},
        "keep_alive": None,
    }
    answer = post(base_url, "/api/chat", llama_index)
    assert answer.status_code == 200 and answer.json()["done"]
    assert (
        post(base_url, "/api/generate", {"model": MODEL, "prompt": "Hi", "options": None, "stream": False}).status_code
        == 200
    )


def test_deprecated_name_field_is_read_as_model(base_url):
    shown = post(base_url, "/api/show", {"name": MODEL})
    assert shown.status_code == 200 and shown.json()["details"]["family"]
    missing = post(base_url, "/api/show", {"name": "no-such:1"})
    assert missing.status_code == 404 and "no-such" in missing.json()["error"]


def test_message_with_null_content_reads_as_empty(base_url):
    # What a client sends back for an assistant turn that carried only tool calls (content: null).
    body = {
        "model": MODEL,
        "stream": False,
        "options": SMALL,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Say hi"},
        ],
    }
    answer = post(base_url, "/api/chat", body)
    assert answer.status_code == 200 and answer.json()["message"]["role"] == "assistant"


def test_think_and_tools_on_a_model_that_cannot_are_400_in_ollamas_words(api):
    with pytest.raises(ollama.ResponseError) as thinking:
        api.chat(model=MODEL, messages=HI, think=True, options=SMALL)
    assert thinking.value.status_code == 400
    assert f'"{MODEL}" does not support thinking' in thinking.value.error
    with pytest.raises(ollama.ResponseError) as generating:
        api.generate(model=MODEL, prompt="Hi", think=True, options=SMALL)
    assert generating.value.status_code == 400 and "does not support thinking" in generating.value.error
    tool = {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}},
    }
    with pytest.raises(ollama.ResponseError) as tools:
        api.chat(model=MODEL, messages=HI, tools=[tool], options=SMALL)
    assert tools.value.status_code == 400 and f"{MODEL} does not support tools" in tools.value.error
    assert api.chat(model=MODEL, messages=HI, think=False, options=SMALL).done  # false asks for nothing


def test_embed_empty_input_preloads_and_dimensions_shorten(api, base_url):
    api.generate(model=MODEL, keep_alive=0)  # unloaded...
    preload = post(base_url, "/api/embed", {"model": MODEL, "input": ""})
    assert preload.status_code == 200 and preload.json()["embeddings"] == []
    assert [m.model for m in api.ps().models] == [MODEL]  # ...and loaded by the empty input
    assert post(base_url, "/api/embed", {"model": MODEL, "input": []}).json()["embeddings"] == []
    full = api.embed(model=MODEL, input="hello").embeddings[0]
    short = api.embed(model=MODEL, input="hello", dimensions=16).embeddings[0]
    assert len(short) == 16 and math.isclose(sum(v * v for v in short), 1.0, rel_tol=1e-6)
    norm = math.sqrt(sum(v * v for v in full[:16]))
    assert short == pytest.approx([v / norm for v in full[:16]], abs=1e-6)
    too_many = post(base_url, "/api/embed", {"model": MODEL, "input": "hello", "dimensions": len(full) + 1})
    assert too_many.status_code == 400 and str(len(full)) in too_many.json()["error"]


def test_show_verbose_fills_the_token_tables(base_url):
    plain = post(base_url, "/api/show", {"model": MODEL}).json()["model_info"]
    assert plain["tokenizer.ggml.tokens"] is None
    verbose = post(base_url, "/api/show", {"model": MODEL, "verbose": True}).json()["model_info"]
    tokens, merges = verbose["tokenizer.ggml.tokens"], verbose["tokenizer.ggml.merges"]
    assert len(tokens) > 40000 and all(isinstance(t, str) for t in tokens[:100])
    assert len(merges) > 1000 and " " in merges[0]
    assert len(verbose["tokenizer.ggml.token_type"]) == len(tokens)


def test_timings_add_up_over_a_prompt_longer_than_one_prefill_chunk(api, base_url):
    api.generate(model=MODEL, keep_alive=0)  # a cold start: the load counts too
    prompt = " ".join(f"item{i}" for i in range(40))  # about 150 tokens: three prefill chunks of 64
    with httpx.stream(
        "POST",
        base_url + "/api/generate",
        timeout=120,
        json={"model": MODEL, "prompt": prompt, "options": {**SMALL, "num_batch": 64}},
    ) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    last = lines[-1]
    assert last["prompt_eval_count"] > 128 and last["prompt_cache_count"] == 0 and last["load_duration"] > 0
    parts = last["load_duration"] + last["prompt_eval_duration"] + last["eval_duration"]
    # Nanoseconds: within 5 ms. Before, the first prefill chunk and the wait for a slot were in no part.
    assert abs(parts - last["total_duration"]) < 5_000_000


def test_create_from_uploaded_files(tmp_path, models_home, tmp_path_factory):
    from localllm.models.store import Store

    home = private_home(models_home, tmp_path_factory.mktemp("files-home"))
    weights = Store(home / "models").resolve(MODEL).weights
    upload = tmp_path / "model.gguf"
    upload.write_bytes(weights.read_bytes())
    weights.unlink()  # the server must receive the bytes
    with served(home) as url:
        api = ollama.Client(host=url)
        digest = "sha256:" + hashlib.sha256(upload.read_bytes()).hexdigest()
        assert httpx.head(f"{url}/api/blobs/{digest}").status_code == 404
        assert api.create_blob(upload) == digest
        assert httpx.head(f"{url}/api/blobs/{digest}").status_code == 200
        wrong = httpx.post(f"{url}/api/blobs/sha256:{'0' * 64}", content=b"other bytes")
        assert wrong.status_code == 400 and "do not match" in wrong.json()["error"]
        done = api.create(model="uploaded:1", files={"model.gguf": digest}, system="Answer in French.")
        assert done.status == "success"
        shown = httpx.post(url + "/api/show", json={"model": "uploaded:1"}).json()
        assert shown["details"]["family"] == "llama" and shown["system"] == "Answer in French."
        assert api.chat(model="uploaded:1", messages=HI, options=SMALL).done
        assert httpx.request("DELETE", url + "/api/delete", json={"name": "uploaded:1"}).status_code == 200
        assert "uploaded:1" not in [m.model for m in api.list().models]
        with pytest.raises(ollama.ResponseError) as missing:
            api.create(model="nope:1", files={"model.gguf": "sha256:" + "1" * 64})
        assert missing.value.status_code == 400 and "upload it first" in missing.value.error
        with pytest.raises(ollama.ResponseError) as safetensors:
            api.create(model="nope:1", files={"model.safetensors": digest})
        assert safetensors.value.status_code == 400 and "GGUF" in safetensors.value.error


GO_TOOLS_TEMPLATE = """{{- if .Tools }}<|im_start|>system
You can call these tools: {{ range .Tools }}{{ json . }}{{ end }}<|im_end|>
{{ end }}
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""


def test_go_templates_at_create_and_request_time(models_home, tmp_path_factory):

    home = private_home(models_home, tmp_path_factory.mktemp("go-home"))
    with served(home) as url:
        api = ollama.Client(host=url)
        assert api.create(model="tooly:1", from_=MODEL, template=GO_TOOLS_TEMPLATE).status == "success"
        # Ollama's deprecated `name` on pull and create, as old clients send it.
        pulled = httpx.post(url + "/api/pull", json={"name": MODEL, "stream": False}, timeout=60).json()
        assert pulled["status"] == "success"
        named = httpx.post(
            url + "/api/create", json={"name": "named:1", "from": MODEL, "stream": False}, timeout=60
        ).json()
        assert named["status"] == "success" and "named:1" in [m.model for m in api.list().models]
        assert "tools" in api.show("tooly:1").capabilities
        tool = {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "The time now",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        assert api.chat(model="tooly:1", messages=HI, tools=[tool], options=SMALL).done
        with pytest.raises(ollama.ResponseError) as refused:
            api.create(model="bad:1", from_=MODEL, template='{{ define "x" }}{{ end }}{{ .Prompt }}')
        assert refused.value.status_code == 400 and "{{ define }}" in refused.value.error
        # A request's own template, in Go syntax, is translated too.
        legacy = "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n{{ .Response }}<|im_end|>"
        answer = httpx.post(
            url + "/api/generate",
            timeout=120,
            json={"model": MODEL, "prompt": "Say hi", "template": legacy, "stream": False, "options": SMALL},
        ).json()
        plain = httpx.post(
            url + "/api/generate",
            timeout=120,
            json={
                "model": MODEL,
                "stream": False,
                "options": SMALL,
                "raw": True,
                "prompt": "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n",
            },
        ).json()
        assert answer["response"] == plain["response"] and answer["prompt_eval_count"] == plain["prompt_eval_count"]


# ---------------------------------------------------------------------------------------------------------- OpenAI


def test_chat_n_choices(oai):
    # Compares answers between requests: the pinned model (speculation off, one thread) keeps them load-free.
    reply = oai.chat.completions.create(model=PINNED, messages=HI, n=3, temperature=1.0, seed=11, max_tokens=12)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1  # seeds 11, 12, 13: different answers to one prompt
    # Choice i samples with seed + i, so choice 0 is the request as sent. Compared between batches of one size: a
    # one-row step may run another matmul kernel than a batch's (llama.cpp on an AMX/AVX-512 Xeon), with slightly
    # different logits, which sampling at temperature 1 can turn into another word.
    shifted = oai.chat.completions.create(model=PINNED, messages=HI, n=3, temperature=1.0, seed=12, max_tokens=12)
    assert [c.message.content for c in shifted.choices][:2] == texts[1:]
    body = ChatCompletionRequest.model_validate({"model": PINNED, "messages": HI, "n": 3, "seed": 11})
    assert [r.options.get("seed") for r in chat_requests(body)] == [11, 12, 13]
    single = oai.chat.completions.create(model=PINNED, messages=HI, temperature=1.0, seed=11, max_tokens=12)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # the shared prompt counted once
    assert reply.usage.completion_tokens >= single.usage.completion_tokens + 2  # every choice's tokens
    chunks = list(
        oai.chat.completions.create(
            model=PINNED, messages=HI, n=2, temperature=1.0, seed=11, max_tokens=12, stream=True
        )
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert [by_index[0], by_index[1]] == texts[:2]
    finishes = [(c.index, c.finish_reason) for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(i for i, _ in finishes) == [0, 1]


def test_n_requests_prefill_their_prompt_once(models_home):
    from localllm import api as llm_api

    with env(LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="3"):
        client = local_client(models_home)
        try:
            prompt = [{"role": "user", "content": "A unique prompt about zebras " + "stripes " * 60}]
            requests = [
                llm_api.ChatRequest(model=MODEL, messages=prompt, options={"seed": i, "num_predict": 4})
                for i in range(3)
            ]
            finals = [chunk for _, chunk in client.chat_batch(requests) if chunk.done]
        finally:
            client.close()
    n_prompt = finals[0].prompt_eval_count
    assert finals[0].prompt_cache_count < n_prompt // 2  # the first computes the prompt...
    assert [f.prompt_cache_count for f in finals[1:]] == [n_prompt - 1, n_prompt - 1]  # ...the others copy it


def test_completions_prompt_list_echo_and_token_ids(oai, base_url):
    many = oai.completions.create(model=MODEL, prompt=["The sky is", "One, two,"], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    alone = [
        oai.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
        for p in ("The sky is", "One, two,")
    ]
    assert [c.text for c in many.choices] == alone
    counts = [
        oai.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).usage.prompt_tokens
        for p in ("The sky is", "One, two,")
    ]
    assert many.usage.prompt_tokens == sum(counts)  # each prompt counted
    crossed = oai.completions.create(model=MODEL, prompt=["The sky is", "One, two,"], n=2, max_tokens=4, temperature=0)
    assert [c.text for c in crossed.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert crossed.usage.prompt_tokens == sum(counts)  # each prompt once, whatever n
    echoed = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "The sky is" + alone[0]
    streamed = list(
        oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "The sky is" + alone[0]
    # The prompt's token ids: Ollama's `context` of a generate whose template is the bare prompt.
    tokens = httpx.post(
        base_url + "/api/generate",
        timeout=60,
        json={
            "model": MODEL,
            "prompt": "The sky is",
            "template": "{{ .Prompt }}",
            "stream": False,
            "options": {"num_predict": 1},
        },
    ).json()
    by_ids = oai.completions.create(model=MODEL, prompt=tokens["context"][:-1], max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == alone[0]


def test_embeddings_token_ids_dimensions_and_empty_input(oai, base_url):
    # langchain-openai's default: its own tokenizer's ids, as int[][], base64-encoded answer.
    langchain = httpx.post(
        base_url + "/v1/embeddings",
        timeout=60,
        json={"input": [[9906, 1917], [15339]], "model": MODEL, "encoding_format": "float"},
    ).json()
    assert [d["index"] for d in langchain["data"]] == [0, 1] and langchain["usage"]["prompt_tokens"] == 3
    one = oai.embeddings.create(model=MODEL, input=[9906, 1917], encoding_format="float").data
    assert one[0].embedding == pytest.approx(langchain["data"][0]["embedding"], abs=1e-5)
    short = oai.embeddings.create(model=MODEL, input="hello", dimensions=8, encoding_format="float").data[0]
    assert len(short.embedding) == 8 and math.isclose(sum(v * v for v in short.embedding), 1.0, rel_tol=1e-5)
    for empty in ("", [], [""], [[]]):
        with pytest.raises(openai.BadRequestError) as info:
            oai.embeddings.create(model=MODEL, input=empty)
        assert info.value.code == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        oai.embeddings.create(model=MODEL, input=[[10**7]])


def test_error_codes_name_the_problem(base_url):
    from localllm.errors import QueueFull
    from localllm.server.responses import error_response

    overflow = post(
        base_url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}
    ).json()["error"]
    assert overflow["code"] == "context_length_exceeded" and overflow["type"] == "invalid_request_error"
    missing = post(base_url, "/v1/completions", {"model": "gone:1", "prompt": "x"}).json()["error"]
    assert missing["code"] == "model_not_found"
    bad = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": "nope"}).json()["error"]
    assert bad["code"] == "invalid_request_error" and isinstance(bad["code"], str)
    full = json.loads(error_response(QueueFull("all slots busy"), "/v1/chat/completions").body)["error"]
    assert full["code"] == "rate_limit_exceeded"


def test_stream_starts_with_the_role_alone(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == "" and chunks[0].choices[0].finish_reason is None
    assert chunks[1].choices[0].delta.role is None and chunks[1].choices[0].delta.content


def test_langchain_openai_and_litellm_bodies(base_url):
    # langchain-openai: n and temperature always sent, an assistant turn with tool calls has content null, a tool
    # result names its call by id. litellm (openai/ provider) adds stream_options to a stream.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    langchain = {
        "model": MODEL,
        "stream": False,
        "n": 1,
        "temperature": 0.0,
        "max_tokens": 16,
        "tools": [tool],
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Weather in Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
    }
    answer = post(base_url, "/v1/chat/completions", langchain)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"
    litellm = {
        "model": MODEL,
        "messages": HI,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 8,
        "temperature": 0,
    }
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=litellm, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] > 0
