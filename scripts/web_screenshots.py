"""Regenerate the web page's pictures in docs/ (the chat, the models page, a phone-width chat) with the real server,
the real model and Debian's chromium driven by Playwright. Also used by scripts/bench_web.py for the browser.

Dev-only, never imported by localllm. Needs a LOCALLLM_HOME that holds smollm2:135m:

    LOCALLLM_HOME=~/.cache/localllm-tests/home .venv/bin/python scripts/web_screenshots.py
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
CHROMIUM = os.environ.get("LOCALLLM_CHROMIUM", "/usr/bin/chromium")
MODEL = "smollm2:135m"
SYSTEM = "You are a helpful AI assistant."
QUESTION = "Show me a Python function that reverses a string, in a code block."
WAIT_MS = 300_000


@contextmanager
def serving() -> Iterator[str]:
    """The real app over LOCALLLM_HOME on a free loopback port, in this process; yields its URL."""
    import uvicorn

    from localllm.server.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(), log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield launched
        finally:
            launched.close()


def open_page(context, url: str):
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(url)
    page.wait_for_selector("body[data-ready=true]")
    return page


def ask(page, text: str, **settings: str):
    """Send `text` in a new chat of MODEL with these settings; returns the finished answer's element."""
    if page.locator("#menu-toggle").is_visible():  # a phone-width page: the list is a drawer
        page.click("#menu-toggle")
    page.click("#new-chat")
    page.select_option("#model", MODEL)
    page.click("#settings-toggle")
    for name, value in settings.items():
        field = page.locator(f"[data-setting={name}]")
        field.fill(value)
        field.dispatch_event("change")
    page.click("#settings-toggle")
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#messages article.assistant:last-child:not(.streaming) .figures:not(:empty)")
    return page.locator("#messages article.assistant").last


def save_pictures(url: str) -> None:
    with browser() as chromium:
        context = chromium.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
        page = open_page(context, url + "/")
        ask(page, QUESTION, system=SYSTEM, temperature="0", num_predict="200")
        page.wait_for_timeout(2500)  # the engine figures' next refresh, after the answer
        page.screenshot(path=str(DOCS / "web-chat.png"))
        page.goto(url + "/#models")
        page.wait_for_selector("#catalog tr")
        page.screenshot(path=str(DOCS / "web-models.png"))
        phone = chromium.new_context(
            viewport={"width": 390, "height": 760}, device_scale_factor=2, is_mobile=True, color_scheme="dark"
        )
        page = open_page(phone, url + "/")
        ask(page, "Three tips for readable Python, briefly.", temperature="0", num_predict="120")
        page.screenshot(path=str(DOCS / "web-phone.png"))


def main() -> None:
    with serving() as url:
        save_pictures(url)
    for name in ("web-chat.png", "web-models.png", "web-phone.png"):
        print(f"wrote {DOCS / name} ({(DOCS / name).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
