"""The web page's figures for scripts/bench.py's `web` section: what its first load transfers, and the time from Send
to the first token painted against the API's own time to the first token for the same request, measured in turn on
one server (Debian's chromium driven by Playwright, as scripts/web_screenshots.py does)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx
from web_screenshots import browser, open_page

from localllm.bench.figures import Figure
from localllm.bench.rest import served_model

PAGE_BUDGET_KB = 500  # the limit for the first load
REPEATS = 5
OPTIONS = {"temperature": 0, "num_predict": 16}


def first_load_kb(chromium, base: str) -> float:
    """Bytes transferred (headers and encoded bodies) for everything a fresh profile loads to show the page."""
    context = chromium.new_context()
    page = context.new_page()
    responses = []
    page.on("response", lambda response: responses.append(response))
    page.goto(base + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.wait_for_load_state("networkidle")
    total = 0
    for response in responses:
        sizes = response.request.sizes()
        total += sizes["responseHeadersSize"] + sizes["responseBodySize"]
    context.close()
    return total / 1024


def api_first_token_ms(base: str, question: str) -> float:
    body = {"model": "bench", "messages": [{"role": "user", "content": question}], "options": OPTIONS}
    started = time.perf_counter()
    elapsed = None
    with httpx.stream("POST", base + "/api/chat", json=body, timeout=300) as response:
        for line in response.iter_lines():  # to the end, so the next request finds the slot free
            if elapsed is None and json.loads(line)["message"]["content"]:
                elapsed = time.perf_counter() - started
    return float("nan") if elapsed is None else elapsed * 1000


def page_first_token_ms(page, question: str) -> float:
    """The page's own measure: Send to the frame that draws the answer's first token (messages.js)."""
    page.click("#new-chat")
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    answer = page.locator("#messages article.assistant:last-child:not(.streaming)[data-ttft-ms]")
    answer.wait_for(timeout=300_000)
    return float(answer.get_attribute("data-ttft-ms") or "nan")


def web_figures(path: Path, *, threads: int | None) -> list[Figure]:
    with served_model(path, slots=1, threads=threads, n_ctx=2048) as base, browser() as chromium:
        size = first_load_kb(chromium, base)
        page = open_page(chromium.new_context(), base + "/")
        page.select_option("#model", "bench:latest")
        page.click("#settings-toggle")
        for name, value in OPTIONS.items():
            page.locator(f"[data-setting={name}]").fill(str(value))
            page.locator(f"[data-setting={name}]").dispatch_event("change")
        ours, reference = [], []
        for i in range(REPEATS):  # each question new, so neither side finds the other's prompt cached
            ours.append(page_first_token_ms(page, f"Question {i} for the page: name a colour."))
            reference.append(api_first_token_ms(base, f"Question {i} for the API: name a colour."))
    return [
        Figure("web page: first load transferred", size, PAGE_BUDGET_KB, "KB", 1.0, lower_is_better=True),
        Figure(
            "web page: Send to first token painted",
            statistics.median(ours),
            statistics.median(reference),
            "ms",
            None,
            lower_is_better=True,
            note=f"against the API's own first token (median of {REPEATS})",
        ),
    ]
