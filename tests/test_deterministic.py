"""Deterministic mode (options.deterministic): the same request answers the same text every time on the same server
and settings, whatever is cached and whatever else runs. Without it a greedy answer changes with the prefill path
(cold, or a cached prefix and a one-token batch), with other requests' rows in its batches, with speculation's verify
batches and with the thread count the tuner picks from measured time."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server_harness import served

pytestmark = pytest.mark.models

# A code edit, as in the report: long enough an answer for the numerics to part, repetitive enough for n-gram drafts.
CODE = "\n".join(
    f"def f{i}(xs):\n    out = []\n    for x in xs:\n        out.append(x * {i})\n    return out\n" for i in range(4)
)
EDIT = [{"role": "user", "content": f"Rewrite each function as a list comprehension with type hints:\n\n{CODE}"}]
OTHER = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the ships she saw."}]


def _chat(url: str, model: str, messages: list[dict], **options) -> str:
    body = {"model": model, "messages": messages, "stream": False, "options": options}
    reply = httpx.post(f"{url}/api/chat", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()["message"]["content"]


@pytest.mark.parametrize("model", ["smollm2:135m", "gemma3:270m"])
def test_the_same_deterministic_request_answers_the_same_text_five_times(models_home, model):
    # Two slots and the thread tuner left on: what changes numerics on a busy server is all there.
    with served(models_home, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2") as url:
        asked = {"temperature": 0, "seed": 7, "num_predict": 64, "deterministic": True}
        answers = [_chat(url, model, EDIT, spec_type="none", **asked)]  # cold
        answers.append(_chat(url, model, EDIT, spec_type="none", **asked))  # its prompt cached in a slot
        answers.append(_chat(url, model, EDIT, spec_type="ngram", **asked))  # speculation asked for

        others = [
            threading.Thread(target=_chat, args=(url, model, OTHER), kwargs={"temperature": 0, "num_predict": 48})
            for _ in range(2)
        ]
        for other in others:
            other.start()
        answers.append(_chat(url, model, EDIT, **asked))  # beside other requests (spec_type left to auto)
        for other in others:
            other.join()
        # Another conversation took the slots meanwhile: its prefix would come back from the RAM tier.
        answers.append(_chat(url, model, EDIT, **asked))
    assert len(answers[0]) > 40
    assert answers == [answers[0]] * 5
