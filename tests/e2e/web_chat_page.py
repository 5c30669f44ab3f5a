"""The web chat's browser tests' shared steps: Debian's chromium driven by playwright, a fresh
page (its own storage) with saved settings, asking, waiting for answers, and steering the
engine's answer where a test needs given text."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Browser, Locator, Page, Request, Route, expect, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
# The page's settings as a person would have saved them: short answers, greedy.
SHORT_ANSWERS = {"maxTokens": "6", "temperature": "0"}


@contextmanager
def chromium() -> Iterator[Browser]:
    assert CHROMIUM.exists(), "the browser tests need Debian's chromium: apt-get install chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield browser
        browser.close()


def open_chat(
    browser: Browser, url: str, settings: dict[str, Any] | None = None, **context: Any
) -> Page:
    """A fresh page (its own storage) of the chat, with `settings` saved beforehand."""
    page = browser.new_context(**context).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.errors = errors  # type: ignore[attr-defined]
    # What the Content-Security-Policy refused, for the tests that look.
    page.add_init_script(
        "window.cspViolations = [];"
        "document.addEventListener('securitypolicyviolation',"
        " (event) => window.cspViolations.push(event.violatedDirective));"
    )
    saved = json.dumps(SHORT_ANSWERS | (settings or {}))
    page.add_init_script(
        f"if (!localStorage.getItem('tandem.settings')) "
        f"localStorage.setItem('tandem.settings', {json.dumps(saved)});"
    )
    page.goto(url)
    # The first /stats answer: the page polls once a second, more on a busy machine.
    expect(page.locator("#status-dot.online")).to_be_attached(timeout=30_000)
    # The message field opens once the page has read its stored conversations and opened one;
    # the status poll starts before that, so without this wait a test that changes the storage
    # could race the page's own start (which writes `tandem.current`).
    expect(page.locator("#input")).to_be_enabled()
    return page


def ask(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.keyboard.press("Enter")


def answers(page: Page) -> Locator:
    return page.locator(".message.assistant")


def wait_answered(page: Page, count: int = 1, timeout_s: float = 60) -> None:
    expect(page.locator(".message.assistant:not(.pending)")).to_have_count(
        count, timeout=timeout_s * 1000
    )


def wait_saved(page: Page) -> None:
    """Until the page has written every conversation it shows (it saves in the background,
    and marks itself ``data-saving`` meanwhile): then a reload reads what it showed."""
    expect(page.locator("html[data-saving]")).to_have_count(0)


def wait_idle(url: str, timeout_s: float = 10) -> None:
    """Until the engine runs no request (an abort crosses from the server to the engine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{url}/stats", timeout=timeout_s)
        if response.status_code == 200 and response.json()["num_running"] == 0:
            return
        assert time.monotonic() < deadline, f"still running: {response.text}"
        time.sleep(0.1)


def force_answer(page: Page, text: str) -> None:
    """The page's next chat requests ask the engine for exactly `text`."""

    def constrain(route: Route) -> None:
        body = json.loads(route.request.post_data or "{}")
        body["structured_outputs"] = {"choice": [text]}
        body["max_tokens"] = 200
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", constrain)


def chat_requests(page: Page) -> list[dict[str, Any]]:
    """The bodies of the chat requests the page sends from now on, as they leave it."""
    bodies: list[dict[str, Any]] = []

    def record(request: Request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            bodies.append(json.loads(request.post_data or "{}"))

    page.on("request", record)
    return bodies


def import_file(page: Page, path: Path, data: Any) -> None:
    """Imports `data` (written to `path`) through the conversation list's Import button."""
    path.write_text(json.dumps(data))
    if not page.locator("#sidebar").is_visible():
        page.click("#toggle-sidebar")
    page.set_input_files("#import-file", str(path))
    expect(page.locator("#import-status")).to_contain_text("Imported")


def not_pwned(page: Page) -> None:
    assert page.evaluate("window.pwned") is None
    assert not page.errors  # type: ignore[attr-defined]
