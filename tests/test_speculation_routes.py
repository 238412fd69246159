"""Speculation through the real server on the real pair: qwen2.5-coder:1.5b drafted by qwen2.5-coder:0.5b, as a
Modelfile's DRAFT line loads it. Greedy answers with the draft model equal the answers without it on both routes
(Ollama's /api/chat and OpenAI's /v1/chat/completions), streamed and not, alone and four at once; `ps` shows the
draft model and /metrics where the drafting time went.

On this 2-core CPU the adaptive window rightly stops drafting with this pair (a draft token costs more than the row
it saves), so the model asks for drafts outright with spec_min_draft (llama-server's --draft-min). Batches of another
shape can flip a near-tie in llama.cpp's CPU kernels: answers may part only where the plain run's two best tokens
were within NEAR_TIE nats, which the plain run's logprobs show."""

from __future__ import annotations

import threading

import httpx
import ollama
import openai
import pytest
from server_harness import local_client, private_home, served

from localllm import api

pytestmark = [pytest.mark.models, pytest.mark.slow]

DRAFTED = "coder-drafted"
N_PREDICT = 40
NEAR_TIE = 0.3
MIN_DRAFT = 4
NAMES = ("total", "amount", "result", "acc")


def edit_prompt(name: str) -> str:
    return (
        "Rewrite this function with the variable `s` renamed to "
        f"`{name}`. Reply with the code only.\n\n```python\ndef add_all(xs):\n    s = 0\n    for x in xs:\n"
        "        s += x\n    return s\n```"
    )


@pytest.fixture(scope="module")
def pair_url(pair_home, tmp_path_factory):
    home = private_home(pair_home, tmp_path_factory.mktemp("pair"))
    client = local_client(home)
    parameters = {
        "temperature": 0,
        "num_thread": 1,
        "num_predict": N_PREDICT,
        "spec_type": "draft",
        "spec_min_draft": MIN_DRAFT,
    }
    create = {"model": DRAFTED, "from": "qwen2.5-coder:1.5b", "draft": "qwen2.5-coder:0.5b", "parameters": parameters}
    try:
        for _ in client.create(api.CreateRequest.model_validate(create)):
            pass
    finally:
        client.close()
    with served(home, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="4") as url:
        yield url


def plain_answer(url: str, name: str) -> list[dict]:
    """The answer without speculation, as each token's logprob and top alternatives."""
    body = {
        "model": DRAFTED,
        "messages": [{"role": "user", "content": edit_prompt(name)}],
        "stream": False,
        "logprobs": True,
        "top_logprobs": 5,
        "options": {"spec_type": "none"},
    }
    reply = httpx.post(f"{url}/api/chat", json=body, timeout=300).json()
    assert reply["draft_count"] == 0
    return reply["logprobs"]


def assert_same_or_near_tie(plain: list[dict], text: str) -> None:
    """`text` spells the plain run's tokens, or parts from them where the plain run was torn between two."""
    pos = 0
    for i, lp in enumerate(plain):
        if text.startswith(lp["token"], pos):
            pos += len(lp["token"])
            continue
        rivals = [
            a["logprob"] for a in lp["top_logprobs"] if a["token"] != lp["token"] and text.startswith(a["token"], pos)
        ]
        assert rivals, f"parted at token {i} ({lp['token']!r}) for a token the plain run did not rank: {text[pos:]!r}"
        assert lp["logprob"] - max(rivals) < NEAR_TIE, f"parted at token {i} where the plain run was sure"
        return
    assert pos == len(text), f"the speculative answer runs on: {text[pos:]!r}"


def ollama_answer(url: str, name: str, *, stream: bool) -> str:
    client = ollama.Client(host=url)
    messages = [{"role": "user", "content": edit_prompt(name)}]
    if stream:
        return "".join(part.message.content or "" for part in client.chat(DRAFTED, messages, stream=True))
    return client.chat(DRAFTED, messages).message.content or ""


def openai_answer(url: str, name: str, *, stream: bool) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages: list = [{"role": "user", "content": edit_prompt(name)}]
    if stream:
        chunks = client.chat.completions.create(model=DRAFTED, messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(model=DRAFTED, messages=messages).choices[0].message.content or ""


@pytest.mark.parametrize("route", [ollama_answer, openai_answer], ids=["ollama", "openai"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_one_answer_with_the_draft_model_is_the_plain_answer(pair_url, route, stream):
    before = _drafted(pair_url)
    assert_same_or_near_tie(plain_answer(pair_url, NAMES[0]), route(pair_url, NAMES[0], stream=stream))
    assert _drafted(pair_url) > before, "nothing was drafted: the test proves nothing"


def test_four_answers_at_once_with_the_draft_model_are_the_plain_answers(pair_url):
    plain = {name: plain_answer(pair_url, name) for name in NAMES}
    answers: dict[str, str] = {}

    def ask(name: str) -> None:
        answers[name] = openai_answer(pair_url, name, stream=True)

    before = _drafted(pair_url)
    threads = [threading.Thread(target=ask, args=(name,)) for name in NAMES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in NAMES:
        assert_same_or_near_tie(plain[name], answers[name])
    assert _drafted(pair_url) > before


def test_ps_shows_the_draft_model_and_metrics_the_time_it_took(pair_url):
    ollama_answer(pair_url, NAMES[1], stream=False)
    row = next(m for m in httpx.get(f"{pair_url}/api/ps").json()["models"] if m["name"].startswith(DRAFTED))
    assert row["speculation"] == "draft"
    draft = row["draft"]
    assert draft["model"] == "qwen2.5-coder:0.5b" and draft["size"] > 10**8
    assert draft["kv_cells"] == 4 * 1024 and draft["threads"] == 1
    assert 0 < row["draft_accepted"] <= row["draft_count"]
    metrics = httpx.get(f"{pair_url}/metrics").text
    assert _metric(metrics, "localllm_spec_tokens_total", 'kind="drafted"') > 0
    for phase in ("draft", "verify", "sample"):
        assert _metric(metrics, "localllm_spec_seconds_total", f'phase="{phase}"') > 0
    assert _metric(metrics, "localllm_spec_acceptance_count", f'model="{DRAFTED}') > 0


def _drafted(url: str) -> int:
    rows = httpx.get(f"{url}/api/ps").json()["models"]
    return sum(m["draft_count"] for m in rows if m["name"].startswith(DRAFTED))


def _metric(text: str, name: str, label: str) -> float:
    """The sum of the samples of `name` whose labels hold `label` (the model label is the name a request used)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line.split("}", 1)[0]
    ]
    assert values, f"no {name} with {label} in /metrics"
    return sum(values)
