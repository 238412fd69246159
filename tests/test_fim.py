"""Fill in the middle for editor completion with a real code model (qwen2.5-coder:0.5b): Ollama's /api/generate
`suffix` (Continue), OpenAI's /v1/completions `suffix`, llama-server's /infill (llama.vscode, llama.vim); the 400
for a model without FIM tokens; a dropped request freeing its slot; consecutive keystrokes reusing the cache."""

from __future__ import annotations

import json
import threading
import time

import httpx
import ollama
import openai
import pytest
from conftest import PINNED_CODER

from localllm.chat.fim import FimInput, FimTokens, fim_prompt

PREFIX = "def fibonacci(n):\n    if n < 2:\n        return n\n"
SUFFIX = "\n\nprint(fibonacci(10))\n"
SHORT = {"num_predict": 16}

# ---------------------------------------------------------------------------------------------------------- prompt

TOKENS = FimTokens(pre=-1, suf=-2, mid=-3, rep=-4, sep=-5)


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_prompt_puts_the_code_between_the_fim_tokens_and_other_files_first():
    text = FimInput(prefix="ab", suffix="cd", middle="e", extra=[("x.py", "X")])
    prompt = fim_prompt(TOKENS, text, _chars, budget=100)
    extra = [-4, *_chars("myproject\n"), -5, *_chars("x.py\n"), *_chars("X"), -5, *_chars("filename\n")]
    assert prompt == [*extra, -1, *_chars("ab"), -2, *_chars("cd"), -3, *_chars("e")]
    plain = fim_prompt(FimTokens(pre=-1, suf=-2, mid=-3), FimInput(prefix="ab", suffix=""), _chars, budget=100, bos=7)
    assert plain == [7, -1, 97, 98, -2, -3]


def test_a_long_file_keeps_the_code_nearest_the_cursor_within_the_budget():
    text = FimInput(prefix="p" * 500 + "NEAR", suffix="NEXT" + "s" * 500, extra=[("big.py", "x" * 900)])
    prompt = fim_prompt(TOKENS, text, _chars, budget=200)
    assert len(prompt) <= 200
    pre, suf, mid = prompt.index(-1), prompt.index(-2), prompt.index(-3)
    assert "".join(map(chr, prompt[pre + 1 : suf])).endswith("NEAR")
    assert "".join(map(chr, prompt[suf + 1 : mid])).startswith("NEXT") and suf - pre > mid - suf


# ---------------------------------------------------------------------------------------------------------- routes


@pytest.mark.models
def test_ollama_generate_with_a_suffix_fills_the_middle(coder_url):
    client = ollama.Client(host=coder_url)
    whole = client.generate(model=PINNED_CODER, prompt=PREFIX, suffix=SUFFIX, options=SHORT)
    assert whole.response.strip() and whole.eval_count > 0
    assert "<|fim" not in whole.response and "<|im_start|>" not in whole.response
    chunks = list(client.generate(model=PINNED_CODER, prompt=PREFIX, suffix=SUFFIX, options=SHORT, stream=True))
    assert "".join(c.response for c in chunks) == whole.response  # pinned: the same tokens


@pytest.mark.models
def test_openai_completions_with_a_suffix_fill_the_middle(coder_url):
    oai = openai.OpenAI(base_url=coder_url + "/v1", api_key="none", max_retries=0)
    whole = oai.completions.create(model=PINNED_CODER, prompt=PREFIX, suffix=SUFFIX, max_tokens=16)
    ollama_answer = ollama.Client(host=coder_url).generate(
        model=PINNED_CODER, prompt=PREFIX, suffix=SUFFIX, options=SHORT
    )
    assert whole.choices[0].text == ollama_answer.response  # one prompt, whichever route builds it
    streamed = oai.completions.create(model=PINNED_CODER, prompt=PREFIX, suffix=SUFFIX, max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


@pytest.mark.models
def test_llama_server_infill_with_other_files(coder_url):
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": "util.py", "text": "def helper():\n    return 1\n"}],
        "prompt": "    ",
        "n_predict": 16,
        "model": PINNED_CODER,
    }
    whole = httpx.post(coder_url + "/infill", json=body, timeout=120).json()
    assert whole["stop"] is True and whole["content"].strip() and whole["tokens_predicted"] > 0
    assert whole["stop_type"] in ("eos", "limit") and whole["timings"]["predicted_n"] == whole["tokens_predicted"]
    with httpx.stream("POST", coder_url + "/infill", json={**body, "stream": True}, timeout=120) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    picked = httpx.post(
        coder_url + "/infill", json={**body, "response_fields": ["content", "timings/cache_n"]}, timeout=120
    ).json()
    assert set(picked) == {"content", "timings/cache_n"} and picked["content"] == whole["content"]


@pytest.mark.models
def test_a_model_without_fim_tokens_is_a_400_on_every_route(coder_url, models_home):
    # smollm2 is in the pinned server's home too (a private copy of the test home)
    for path, body in (
        ("/api/generate", {"model": "smollm2:135m", "prompt": "a", "suffix": "b", "stream": False}),
        ("/v1/completions", {"model": "smollm2:135m", "prompt": "a", "suffix": "b"}),
        ("/infill", {"model": "smollm2:135m", "input_prefix": "a", "input_suffix": "b"}),
    ):
        reply = httpx.post(coder_url + path, json=body, timeout=120)
        assert reply.status_code == 400, path
        assert "does not support insert" in reply.text


@pytest.mark.models
def test_keystrokes_reuse_the_cached_prefix(coder_url):
    typed = ""
    cached = []
    for key in "return fib":
        typed += key
        body = {"model": PINNED_CODER, "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "    " + typed}
        reply = httpx.post(coder_url + "/infill", json={**body, "n_predict": 2}, timeout=120).json()
        cached.append((reply["timings"]["cache_n"], reply["tokens_evaluated"]))
    # Only the cursor line changes: each keystroke after the first finds all the rest in the cache.
    assert all(cache_n >= evaluated - 8 for cache_n, evaluated in cached[1:]), cached


@pytest.mark.models
@pytest.mark.parametrize("stream", [True, False])
def test_a_dropped_request_frees_its_slot(coder_url, stream):
    """The editor drops the last keystroke's request: with one slot, the next one runs only if the dropped one
    left it. The dropped one would run to the end of the context; its slot is free long before."""
    endless = {
        "model": PINNED_CODER,
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "n_predict": 4000,
        "stream": stream,
    }
    httpx.post(coder_url + "/infill", json={**endless, "n_predict": 1, "stream": False}, timeout=120)  # loaded
    started = threading.Event()

    def drop() -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(120, read=3)) as http:
                with http.stream("POST", coder_url + "/infill", json={**endless, "ignore_eos": True}) as reply:
                    started.set()
                    for _ in reply.iter_bytes():
                        return  # one piece read, then the connection is dropped
        except httpx.ReadTimeout:
            pass  # the non-streamed request: the client gives up waiting
        finally:
            started.set()

    dropper = threading.Thread(target=drop)
    dropper.start()
    started.wait(120)
    dropper.join(120)
    busy = _slots_busy(coder_url)
    deadline = time.monotonic() + 60  # the cancel takes a step; the answer would take many minutes
    while busy and time.monotonic() < deadline:
        time.sleep(0.2)
        busy = _slots_busy(coder_url)
    assert busy == 0
    reply = httpx.post(coder_url + "/infill", json={**endless, "n_predict": 4, "stream": False}, timeout=120)
    assert reply.status_code == 200 and reply.json()["tokens_predicted"] > 0


def _slots_busy(url: str) -> int:
    return sum(m.get("slots_busy", 0) for m in httpx.get(url + "/api/ps", timeout=30).json()["models"])
