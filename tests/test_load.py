"""Load: 32 concurrent streaming clients (half `openai`, half `ollama`) on 4 slots with a queue of 4. Every request
either completes correctly or gets 503 with Retry-After; none hangs; the server stays up, every slot is freed after
each round, and memory does not grow across rounds."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import ollama
import openai
import pytest
from server_harness import served

pytestmark = [pytest.mark.models, pytest.mark.slow]

CLIENTS = 32
ROUNDS = 5
TOKENS = 6
MESSAGES = [{"role": "user", "content": "Name a color."}]


@dataclass
class Outcome:
    completed: bool = False
    refused: bool = False  # 503 with Retry-After
    problem: str | None = None


@pytest.fixture(scope="module")
def base_url(models_home):
    with served(models_home, LOCALLLM_NUM_PARALLEL="4", LOCALLLM_MAX_QUEUE="4", LOCALLLM_CONTEXT_LENGTH="512") as url:
        yield url


def via_openai(url: str) -> Outcome:
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        chunks = list(
            oai.chat.completions.create(
                model="smollm2:135m", messages=MESSAGES, max_tokens=TOKENS, temperature=0, stream=True
            )
        )
    except openai.APIStatusError as exc:
        return refused(exc.status_code, exc.response.headers.get("retry-after"))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return Outcome(completed=True) if finish in (["stop"], ["length"]) and text else Outcome(problem=repr(chunks[-3:]))


def via_ollama(url: str) -> Outcome:
    api = ollama.Client(host=url, timeout=120)
    try:
        chunks = list(
            api.chat(
                model="smollm2:135m", messages=MESSAGES, stream=True, options={"num_predict": TOKENS, "temperature": 0}
            )
        )
    except ollama.ResponseError as exc:
        return refused(exc.status_code, None, headers_seen=False)  # the ollama package drops the headers
    last = chunks[-1]
    ok = last.done and last.done_reason in ("stop", "length") and 0 < last.eval_count <= TOKENS
    return Outcome(completed=True) if ok else Outcome(problem=repr(last))


def refused(status: int, retry_after: str | None, *, headers_seen: bool = True) -> Outcome:
    if status == 503 and (retry_after or not headers_seen):
        return Outcome(refused=True)
    return Outcome(problem=f"status {status}, Retry-After {retry_after!r}")


def run_round(url: str) -> list[Outcome]:
    outcomes: list[Outcome | None] = [None] * CLIENTS
    start = threading.Barrier(CLIENTS)

    def client(i: int, call: Callable[[str], Outcome]) -> None:
        start.wait()
        try:
            outcomes[i] = call(url)
        except Exception as exc:  # noqa: BLE001 - any other failure is a finding, reported below
            outcomes[i] = Outcome(problem=repr(exc))

    threads = [
        threading.Thread(target=client, args=(i, via_openai if i % 2 else via_ollama), daemon=True)
        for i in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a client hung"
    return [o for o in outcomes if o is not None]


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 60
    while any(m["slots_busy"] or m["queue_depth"] for m in httpx.get(url + "/api/ps").json()["models"]):
        assert time.monotonic() < deadline, "slots stayed busy after the round"
        time.sleep(0.05)


def rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_32_streaming_clients_on_4_slots(base_url):
    rss = []
    for _ in range(ROUNDS):
        outcomes = run_round(base_url)
        assert len(outcomes) == CLIENTS
        problems = [o.problem for o in outcomes if o.problem]
        assert not problems, problems[:3]
        assert sum(o.completed for o in outcomes) >= 4  # at least a full set of slots was served
        assert sum(o.completed or o.refused for o in outcomes) == CLIENTS
        wait_idle(base_url)
        rss.append(rss_bytes())
    assert httpx.get(base_url + "/health").status_code == 200
    # The first round warms caches, pools and thread stacks; after it, rounds must not keep adding memory.
    growth = rss[-1] - rss[1]
    assert growth < 48 * 2**20, f"memory grew by {growth / 2**20:.1f} MiB over {ROUNDS - 2} rounds: {rss}"
    metrics = httpx.get(base_url + "/metrics").text
    assert 'localllm_generated_tokens_total{model="smollm2:135m"}' in metrics
    assert 'localllm_slots_busy{model="smollm2:135m"} 0.0' in metrics
