"""Reranking (/v1/rerank and /rerank) on a real cross-encoder GGUF: a tiny BERT with rank pooling and a classifier
head written in tests/rerank_model.py (no real reranker ships offline), created into a private home with
`localllm create`, served by the real app. Its scores must equal llama.cpp's own llama-server --rerank on the same
file; every bad request is a 400 that says what to change, and the server answers the next request."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from reference_tools import reference_tool
from rerank_model import write_reranker
from server_harness import free_port, private_home, served

from localllm import api
from localllm.errors import InvalidInput

pytestmark = pytest.mark.models  # the private home holds the catalog models too (smollm2 is the model without a head)

RERANKER = "tiny-reranker"
# The two ways llama-server lays out a pair, each a model of its own: the vocabulary's special tokens, or the GGUF's
# `rerank` template (whose [CLS] and [SEP] are parsed as the special tokens they name).
LAYOUTS = {RERANKER: None, "tiny-reranker-templated": "[CLS]query: {query}[SEP]document: {document}[SEP]"}
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "the cat hides in the garden",
    "rain and sun over the river",
    "a compiler measures the broken clock",
    "Where is Paris? In France, of course!",
    "the violin describes a song",
    "invoice 42 follows the report",
    "satellite map of the glacier",
    "the bakery on the city",
    "what is the weather in paris",
    "xyzzy plugh",
    "the capital city",
]


@pytest.fixture(scope="module")
def reranker_ggufs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("reranker")
    return {name: write_reranker(folder / f"{name}.gguf", template=template) for name, template in LAYOUTS.items()}


@pytest.fixture(scope="module")
def url(models_home, reranker_ggufs, tmp_path_factory) -> Iterator[str]:
    """The real server on a home with the catalog models and the rerankers, created as a user would create them."""
    home = private_home(models_home, tmp_path_factory.mktemp("rerank-home"))
    for name, path in reranker_ggufs.items():
        modelfile = home / f"{name}.Modelfile"
        modelfile.write_text(f"FROM {path}\n")
        created = subprocess.run(
            [sys.executable, "-m", "localllm", "create", name, "-f", str(modelfile)],
            env={**os.environ, "LOCALLLM_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert created.returncode == 0, created.stderr
    with served(home, LOCALLLM_NUM_PARALLEL="1") as base:
        yield base


def rerank(url: str, path: str = "/v1/rerank", **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": RERANKER, "query": QUERY} | body, timeout=120)


def message(reply: httpx.Response) -> str:
    """The error's text: OpenAI's object under /v1, Ollama's plain string elsewhere."""
    error = reply.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def scores(reply: dict) -> dict[int, float]:
    return {result["index"]: result["relevance_score"] for result in reply["results"]}


# ------------------------------------------------------------------------------------------------ the reference


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def reference(request, reranker_ggufs) -> Iterator[tuple[str, str]]:
    """llama.cpp's own llama-server with --rerank on the same file, on a free loopback port. Flash attention off, as
    we score: its F16 rounding moves a score by ~1e-3 with the length of the batch the pair shares."""
    port = free_port()
    command = [reference_tool("llama-server"), "-m", str(reranker_ggufs[request.param]), "--rerank", "-fa", "off"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, process)
        yield request.param, base
    finally:
        process.terminate()
        process.wait(timeout=30)


def wait_healthy(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"llama-server exited ({process.returncode}): {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail("llama-server did not become healthy in 120 s")


def test_scores_equal_llama_servers(url, reference):
    model, theirs_url = reference
    ours = rerank(url, documents=DOCUMENTS, model=model)
    theirs = httpx.post(f"{theirs_url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=120)
    assert ours.status_code == 200, ours.text
    assert theirs.status_code == 200, theirs.text
    ours_scores, their_scores = scores(ours.json()), scores(theirs.json())
    assert set(ours_scores) == set(their_scores) == set(range(len(DOCUMENTS)))
    worst = max(abs(ours_scores[i] - their_scores[i]) for i in ours_scores)
    print(f"{model}: max |ours - llama-server| = {worst:.3g} over {len(DOCUMENTS)} documents")
    assert worst < 1e-4, (worst, ours_scores, their_scores)
    assert [r["index"] for r in ours.json()["results"]] == [r["index"] for r in theirs.json()["results"]]
    # Each pair is counted as llama-server counts it: the same tokens, laid out the same way.
    assert ours.json()["usage"] == theirs.json()["usage"]


# ------------------------------------------------------------------------------------------------ the answer


def test_the_answer_has_the_shared_shape_best_first(url):
    reply = rerank(url, documents=DOCUMENTS)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == RERANKER and body["object"] == "list"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    assert all(set(r) == {"index", "relevance_score"} for r in results)  # documents only when asked for
    assert len(set(scores(body).values())) > 1  # the documents are told apart


def test_rerank_is_the_same_route(url):
    assert scores(rerank(url, "/rerank", documents=DOCUMENTS).json()) == scores(rerank(url, documents=DOCUMENTS).json())


def test_top_n_and_return_documents(url):
    full = rerank(url, documents=DOCUMENTS).json()["results"]
    top = rerank(url, documents=DOCUMENTS, top_n=3, return_documents=True).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:3]]
    assert [r["document"]["text"] for r in top] == [DOCUMENTS[r["index"]] for r in top]
    assert len(rerank(url, documents=DOCUMENTS, top_n=100).json()["results"]) == len(DOCUMENTS)


def test_a_batch_scores_each_document_as_alone(url):
    """64 documents decode together; each scores what it scores in a request of its own."""
    many = [DOCUMENTS[i % len(DOCUMENTS)] + f" {i}" for i in range(64)]
    together = scores(rerank(url, documents=many).json())
    for i in (0, 17, 63):
        alone = scores(rerank(url, documents=[many[i]]).json())[0]
        assert abs(together[i] - alone) < 1e-4


def test_show_lists_rerank_as_the_capability(url):
    shown = httpx.post(f"{url}/api/show", json={"model": RERANKER}, timeout=60).json()
    assert shown["capabilities"] == ["rerank"]
    chat = httpx.post(f"{url}/api/show", json={"model": "smollm2:135m"}, timeout=60).json()
    assert "rerank" not in chat["capabilities"]


def test_the_http_client_reranks(url):
    from localllm.client.http import HttpClient

    with HttpClient(url) as client:
        reply = client.rerank(api.RerankRequest(model=RERANKER, query=QUERY, documents=DOCUMENTS[:4], top_n=2))
        assert len(reply.results) == 2 and reply.results[0].relevance_score >= reply.results[1].relevance_score
        with pytest.raises(InvalidInput, match="document 0 is an empty string"):
            client.rerank(api.RerankRequest(model=RERANKER, query=QUERY, documents=[""]))


def test_the_layouts_pair_differently(url):
    """The templated model reads other tokens for the same pair: its template, not the special tokens, laid it out."""
    plain = rerank(url, documents=DOCUMENTS[:1]).json()["usage"]["prompt_tokens"]
    templated = rerank(url, documents=DOCUMENTS[:1], model="tiny-reranker-templated").json()["usage"]
    assert templated["prompt_tokens"] > plain


# ------------------------------------------------------------------------------------------------ what is refused

LONG = " ".join(["capital"] * 600)  # one token a word: over the reranker's 512-token context with the query

REFUSED = {
    "no classifier head": ({"model": "smollm2:135m", "documents": ["a"]}, "does not rerank: it has no classifier head"),
    "no documents": ({"documents": []}, "documents is empty"),
    "too many documents": ({"documents": ["a"] * (api.MAX_RERANK_DOCUMENTS + 1)}, "documents"),
    "a pair over the context": ({"documents": ["a", LONG]}, "document 1 with the query is"),
    "an empty query": ({"query": "", "documents": ["a"]}, "query is empty"),
    "an empty document": ({"documents": ["a", ""]}, "document 1 is an empty string"),
    "top_n 0": ({"documents": ["a"], "top_n": 0}, "top_n"),
    "documents not strings": ({"documents": [{"x": 1}]}, "documents"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_request_is_a_400_and_the_next_one_is_answered(url, case):
    body, words = REFUSED[case]
    reply = rerank(url, **body)
    assert reply.status_code == 400, reply.text
    assert words in message(reply)
    after = rerank(url, documents=DOCUMENTS[:2])
    assert after.status_code == 200 and len(after.json()["results"]) == 2


def test_a_reranker_does_not_embed(url):
    reply = httpx.post(f"{url}/v1/embeddings", json={"model": RERANKER, "input": "a cat"}, timeout=60)
    assert reply.status_code == 400 and "reranker" in message(reply)


EXTREMES = [None, True, -1, 0, 2**31, 2**63, 1e308, 0.5, "", "x" * 200_000, "\u0000", "🙂" * 1000, [], {}, [None]]
EXTREMES += [["x"] * 5000, ["", "a"], [1, 2], [["a"]], [{"text": "a"}], ["\u0000"], ["🙂" * 3000], {"a": {"b": {}}}]


@pytest.mark.parametrize("field", ["model", "query", "documents", "top_n", "return_documents", "options"])
def test_no_value_of_a_field_is_a_server_error(url, field):
    """Every extreme in each field is answered (200, or 4xx saying why), never a 500; the server answers after."""
    statuses = {}
    for value in EXTREMES:
        reply = rerank(url, **{"documents": DOCUMENTS[:2], field: value})
        statuses[repr(value)[:40]] = reply.status_code
    assert all(status < 500 for status in statuses.values()), statuses
    assert rerank(url, documents=DOCUMENTS[:2]).status_code == 200
