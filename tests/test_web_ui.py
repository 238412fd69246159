"""The browser page (localllm/web/) in a real browser: Debian's chromium driven by Playwright, against the real
server on loopback with the catalog models. One server, one browser per module; each test opens its own page.

Waits are conditions with generous deadlines, never timings: the suite also runs on a busy two-core machine."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import local_client, private_home, served

from localllm import api

pytestmark = pytest.mark.models

CHROMIUM = os.environ.get("LOCALLLM_CHROMIUM", "/usr/bin/chromium")
WAIT_MS = 180_000  # a deadline for conditions, not a timing: a busy CI machine is slow
FREED_SECONDS = 60  # the long answer below needs minutes: a slot free sooner was freed by Stop
KEY = "web-test-key"
SMALL = "smollm2:135m"
# smollm2 writing until its context is full (num_predict and ignore_eos): a Stop always lands mid-answer.
LONG = "web-long:1"
LONG_PARAMETERS = {"temperature": 0, "num_predict": 8000, "num_ctx": 8192, "ignore_eos": True, "spec_type": "none"}
# Both parse as HTML in markdown (CommonMark's raw HTML); either would open a dialog if it ran.
PAYLOAD = "<img src=x onerror=alert(1)><script>alert(2)</script>"


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"no chromium at {CHROMIUM}: scripts/test.sh installs Debian's (or set LOCALLLM_CHROMIUM)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def web_url(models_home, tmp_path_factory) -> Iterator[str]:
    """The server on a private home holding the catalog models and LONG."""
    home = private_home(models_home, tmp_path_factory.mktemp("web"))
    client = local_client(home)
    for _ in client.create(api.CreateRequest(model=LONG, from_=SMALL, parameters=LONG_PARAMETERS)):
        pass
    client.close()
    with served(home, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2") as url:
        yield url


@pytest.fixture(scope="module")
def context(browser):
    """One browser profile for the module's chat tests: conversations persist across its pages, as in a user's."""
    made = browser.new_context()
    yield made
    made.close()


def open_page(context, url: str):
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready=true]")
    return page


def new_chat(page, model: str, **settings: str) -> None:
    page.click("#new-chat")
    page.select_option("#model", model)
    if settings:
        page.click("#settings-toggle")
        for name, value in settings.items():
            field = page.locator(f"[data-setting={name}]")
            field.fill(value)
            field.dispatch_event("change")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_for_answer(page):
    """The last answer, once it has finished streaming."""
    page.wait_for_selector("#messages article.assistant:last-child:not(.streaming) .figures:not(:empty)")
    return page.locator("#messages article.assistant").last


def wait_until(condition, seconds: float = WAIT_MS / 1000) -> None:
    """Poll in Python: the page's CSP forbids the string evaluation Playwright's wait_for_function uses."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def slots_busy(url: str, headers: dict[str, str] | None = None) -> int:
    models = httpx.get(url + "/api/ps", headers=headers).json()["models"]
    return sum(m["slots_busy"] for m in models)


def test_root_gives_browsers_the_page_and_clients_the_text(web_url):
    assert httpx.get(web_url + "/").text == "localllm is running"  # probes and Ollama-style clients
    page = httpx.get(web_url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.headers["content-type"].startswith("text/html") and '<script type="module"' in page.text
    for response in (page, httpx.get(web_url + "/ui/app.js")):
        csp = response.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "unsafe" not in csp and "connect-src 'self'" in csp
        assert response.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(web_url + "/ui/app.js").headers["content-encoding"] == "gzip"
    assert httpx.get(web_url + "/ui/%2e%2e/server/app.py").status_code == 404


def test_a_message_streams_and_the_conversation_survives_a_reload(context, web_url):
    page = open_page(context, web_url)
    new_chat(page, SMALL, num_predict="24", temperature="0")
    send(page, "Name three colours.")
    page.wait_for_selector("#messages article.assistant.streaming")
    answer = wait_for_answer(page)
    text = answer.locator(".body").inner_text()
    assert text.strip()
    assert "tokens" in answer.locator(".figures").inner_text()

    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#conversations .title", has_text="Name three colours.").count() == 1
    assert page.locator("#messages article.user .body").last.inner_text() == "Name three colours."
    assert page.locator("#messages article.assistant .body").last.inner_text() == text
    page.close()


def test_stop_frees_the_slot_at_once_and_keeps_the_partial_answer(context, web_url):
    page = open_page(context, web_url)
    new_chat(page, LONG)
    send(page, "Tell a long story.")
    page.wait_for_selector("#messages article.assistant.streaming .body:not(:empty)")
    assert slots_busy(web_url) == 1
    page.click("#stop")
    page.wait_for_selector("#messages article.assistant:last-child .partial:has-text('stopped')")
    wait_until(lambda: slots_busy(web_url) == 0, FREED_SECONDS)
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#messages article.assistant .partial").last.inner_text() == "Answer stopped"
    page.close()


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_image_for_a_text_model_is_refused_in_the_page(context, web_url):
    page = open_page(context, web_url)
    new_chat(page, SMALL)
    page.set_input_files("#attach", files=[{"name": "red.png", "mimeType": "image/png", "buffer": _png()}])
    page.wait_for_selector("#attachments .chip:has-text('red.png')")
    send(page, "What is in this picture?")
    page.wait_for_selector("#error:has-text('this model is missing data required for image input')")
    assert page.locator("#messages article.assistant").count() == 0  # no empty answer left behind
    page.close()


def test_html_in_an_answer_or_an_imported_title_runs_nothing(context, web_url):
    page = open_page(context, web_url)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    # A response format whose only valid answer is the payload: the real model streams it, token by token.
    new_chat(page, SMALL, format=json.dumps({"type": "string", "const": PAYLOAD}))
    send(page, "Say something.")
    body = wait_for_answer(page).locator(".body")
    assert body.locator("img").count() == 1  # the answer's HTML arrived and was parsed...
    assert page.locator("#messages [onerror], #messages script").count() == 0  # ...and sanitised
    imported = {"title": PAYLOAD, "messages": [{"role": "assistant", "content": PAYLOAD}]}
    page.set_input_files(
        "#import", files=[{"name": PAYLOAD, "mimeType": "application/json", "buffer": json.dumps(imported).encode()}]
    )
    page.locator("#conversations .title").filter(has_text=PAYLOAD).wait_for()  # the title shown as text
    assert page.locator("#messages [onerror], #messages script").count() == 0
    page.wait_for_timeout(500)  # a dialog opened by an image's failed load would be reported by now
    assert dialogs == []
    page.close()


def test_a_phone_width_screen_keeps_the_chat_usable(browser, web_url):
    phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = open_page(phone, web_url)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")  # nothing sideways
    assert page.locator("#sidebar").bounding_box()["x"] < 0  # the list is a drawer, closed
    composer = page.locator("#composer").bounding_box()
    assert composer["x"] >= 0 and composer["x"] + composer["width"] <= 390
    page.click("#menu-toggle")
    wait_until(lambda: page.locator("#sidebar").bounding_box()["x"] >= 0)
    page.click("#new-chat")  # opening a chat closes the drawer again
    box = page.locator("#sidebar").bounding_box
    wait_until(lambda: box()["x"] + box()["width"] <= 0)
    phone.close()


@pytest.fixture(scope="module")
def keyed_url(models_home, tmp_path_factory) -> Iterator[str]:
    """A server that wants a key, on a home whose smollm2 manifest is gone (its blob stays: the pull only checks it
    and writes the manifest, so no download)."""
    from localllm.models.store import Store

    home = private_home(models_home, tmp_path_factory.mktemp("web-keyed"))
    Store(home / "models").delete(SMALL)
    with served(home, LOCALLLM_API_KEY=KEY) as url:
        yield url


def test_with_a_key_the_page_asks_once_then_pulls_plans_and_deletes(browser, keyed_url):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(keyed_url + "/#models")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-dialog input", "not-the-key")
    page.press("#key-dialog input", "Enter")
    page.wait_for_selector("#key-dialog[open] .wrong:visible")  # refused: asked again, saying so
    page.fill("#key-dialog input", KEY)
    page.press("#key-dialog input", "Enter")
    page.wait_for_selector("body[data-ready=true]")
    page.reload()  # kept for the session: not asked again
    page.wait_for_selector("body[data-ready=true]")
    page.wait_for_selector("#catalog tr")
    assert page.locator("#key-dialog[open]").count() == 0

    page.fill("#pull-name", SMALL)
    page.click("#pull-button")
    page.wait_for_selector("#pull-status:has-text('done')")
    assert page.evaluate("document.getElementById('pull-progress').value") == 1
    row = page.locator(f"#stored tr[data-model='{SMALL}']")
    row.wait_for()

    page.fill("#plan-ctx", "512")  # the memory plan, before anything loads
    row.locator("button", has_text="Plan").click()
    planned = page.locator(f"#plan-result .plan-row[data-model='{SMALL}']")
    planned.wait_for()
    assert "× 512 tokens" in planned.inner_text()
    assert "available: fits" in page.locator("#plan-result .plan-verdict").inner_text()
    page.fill("#plan-ctx", "1000000")
    page.fill("#plan-slots", "64")
    row.locator("button", has_text="Plan").click()
    page.wait_for_selector("#plan-result .plan-verdict:has-text('does not fit')")
    assert httpx.get(keyed_url + "/api/ps", headers={"Authorization": f"Bearer {KEY}"}).json()["models"] == []

    row.locator("button", has_text="Delete").click()
    row.locator("button.confirm").click()
    row.wait_for(state="detached")
    tags = httpx.get(keyed_url + "/api/tags", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert SMALL not in [m["name"] for m in tags["models"]]
    context.close()


def test_the_page_says_when_the_server_listens_beyond_this_machine(browser, models_home, tmp_path_factory, web_url):
    from server_harness import serve_in_thread

    from localllm.server.app import create_app

    # bound_host is what the app was told it listens on; the test server itself stays on loopback
    client = local_client(private_home(models_home, tmp_path_factory.mktemp("web-network")))
    try:
        with serve_in_thread(create_app(client, bound_host="0.0.0.0")) as network_url:
            assert httpx.get(network_url + "/health").json()["network"] is True
            page = open_page(browser.new_context(), network_url)
            reach = page.locator("#reach")
            assert reach.is_visible() and "with no API key" in reach.inner_text()
            page.context.close()
    finally:
        client.close()
    assert httpx.get(web_url + "/health").json()["network"] is False
    page = open_page(browser.new_context(), web_url)
    assert page.locator("#reach").is_hidden()
    page.context.close()
