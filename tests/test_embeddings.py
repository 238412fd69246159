"""Embeddings that mean something: nomic-embed-text-v1.5 on the real server, through /api/embed (the `ollama`
package, as LangChain's OllamaEmbeddings calls it), /api/embeddings and /v1/embeddings (the `openai` package).

nomic wants task prefixes; the server adds none, so the texts here carry them as a client would."""

from __future__ import annotations

import math

import httpx
import numpy as np
import ollama
import openai
import pytest
from server_harness import served

from localllm.backends.llama_cpp import embedding
from localllm.backends.llama_cpp.embedding import pack, pack_limit

MODEL = "nomic-embed-text"
QUERY = "search_query: Why do cats purr?"
CAT = "search_document: Cats purr when they are content, and sometimes to soothe themselves when hurt."
TAX = "search_document: Income tax returns must be filed by the fifteenth of April."


@pytest.fixture(scope="module")
def base_url(embed_home):
    with served(embed_home, LOCALLLM_NUM_PARALLEL="1") as url:
        yield url


@pytest.fixture(scope="module")
def api(base_url) -> ollama.Client:
    return ollama.Client(host=base_url, timeout=300)


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300)


def _cos(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _closer_to_cat(query, cat, tax) -> bool:
    return _cos(query, cat) > _cos(query, tax) + 0.1


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=300)


@pytest.mark.models
def test_a_query_about_cats_is_closest_to_the_cat_document_on_every_route(api, oai, base_url):
    # /api/embed the way langchain-ollama's OllamaEmbeddings sends it: every option it knows, unset ones null.
    options = dict.fromkeys(("mirostat", "num_ctx", "num_gpu", "num_thread", "temperature", "stop", "top_k", "top_p"))
    ollama_vectors = api.embed(model=MODEL, input=[QUERY, CAT, TAX], options=options, keep_alive=None).embeddings
    assert len(ollama_vectors) == 3 and all(len(v) == 768 for v in ollama_vectors)
    assert all(math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-5) for v in ollama_vectors)
    assert _closer_to_cat(*ollama_vectors)

    legacy = [api.embeddings(model=MODEL, prompt=text).embedding for text in (QUERY, CAT, TAX)]
    assert _closer_to_cat(*legacy)
    openai_vectors = [d.embedding for d in oai.embeddings.create(model=MODEL, input=[QUERY, CAT, TAX]).data]
    assert _closer_to_cat(*openai_vectors)
    # The same texts, the same vectors, whichever route (batched or alone: the batch shape moves only rounding).
    for routed in (legacy, openai_vectors):
        for a, b in zip(routed, ollama_vectors):
            assert _cos(a, b) > 0.9999


@pytest.mark.models
def test_batched_inputs_decode_together(api, monkeypatch):
    decodes = []
    real = embedding.embed_group
    monkeypatch.setattr(
        embedding, "embed_group", lambda ctx, group, n: decodes.append(len(group)) or real(ctx, group, n)
    )
    texts = [f"search_document: note number {i} about the weather" for i in range(10)]
    together = api.embed(model=MODEL, input=texts).embeddings
    assert decodes == [10]  # ten short texts fit one decode
    alone = api.embed(model=MODEL, input=texts[3]).embeddings[0]
    assert _cos(together[3], alone) > 0.9999 and _cos(together[3], together[4]) < 0.9999


def test_inputs_are_packed_into_decodes_that_fit_the_context():
    assert [list(run) for run in pack([[1] * 5, [1] * 5, [1] * 5], n_ctx=10)] == [[0, 1], [2]]
    assert [list(run) for run in pack([[1]] * 5, n_ctx=100, max_seqs=2)] == [[0, 1], [2, 3], [4]]
    assert [list(run) for run in pack([[1] * 10, [1]], n_ctx=10)] == [[0], [1]]


def test_a_small_encoder_packs_fewer_cells_than_its_context():
    """Masked attention over a whole packed decode costs a small model more than packing saves: a
    64-wide reranker packs 128 cells a decode; a 768-wide embedder (nomic) 1536 of its 2048."""
    assert pack_limit(512, 64) == 128
    assert pack_limit(2048, 768) == 1536
    assert pack_limit(512, 1024) == 512


@pytest.mark.models
def test_truncate_cuts_to_the_context_or_refuses(base_url):
    long_text = "search_document: " + "the cat sat on the mat. " * 100  # about 700 tokens
    small = {"num_ctx": 256}
    refused = post(base_url, "/api/embed", {"model": MODEL, "input": long_text, "truncate": False, "options": small})
    assert refused.status_code == 400 and "256" in refused.json()["error"]
    cut = post(base_url, "/api/embed", {"model": MODEL, "input": long_text, "options": small})  # truncate: true
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 256
    assert len(cut.json()["embeddings"][0]) == 768


@pytest.mark.models
def test_dimensions_keep_the_first_ones_renormalised(api, oai, base_url):
    full = api.embed(model=MODEL, input=[QUERY, CAT, TAX]).embeddings
    short = api.embed(model=MODEL, input=[QUERY, CAT, TAX], dimensions=256).embeddings
    head = np.array(full[0][:256])
    assert np.allclose(short[0], head / np.linalg.norm(head), atol=1e-5)
    assert _closer_to_cat(*short)  # Matryoshka: the first 256 dimensions still rank the documents
    data = oai.embeddings.create(model=MODEL, input=QUERY, dimensions=64, encoding_format="float").data
    assert len(data[0].embedding) == 64
    for bad in (0, 769):
        reply = post(base_url, "/api/embed", {"model": MODEL, "input": QUERY, "dimensions": bad})
        assert reply.status_code == 400, reply.text
    assert post(base_url, "/v1/embeddings", {"model": MODEL, "input": QUERY, "dimensions": 769}).status_code == 400


@pytest.mark.models
def test_an_embedding_model_refuses_to_generate_and_shows_what_it_does(api, base_url):
    for path, body in (
        ("/api/generate", {"model": MODEL, "prompt": "hi", "stream": False}),
        ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        reply = post(base_url, path, body)
        assert reply.status_code == 400 and "embedding model" in reply.text, (path, reply.text)
    shown = api.show(MODEL)
    assert shown.capabilities == ["embedding"] and shown.license == "Apache-2.0"
