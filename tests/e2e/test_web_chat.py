"""The web chat in a real browser (Debian's chromium, driven by playwright) against the real
engine and servers of the `cluster` fixture: what a person does, and what must stay inert.

Answers are kept to a few tokens (the page's max-tokens setting) so that the whole file runs
in well under a minute on a CPU. Where a test needs a given answer, it asks the engine for
exactly that text through a structured-output choice added to the page's request in flight
(the model still writes it, token by token); renderer checks that need no engine go
through the page's own import path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from tests.conftest import Cluster

CHROMIUM = Path("/usr/bin/chromium")
# The page's settings as a person would have saved them: short answers, greedy.
SHORT_ANSWERS = {"maxTokens": "6", "temperature": "0"}
PAYLOADS = [
    '<img src="x" onerror="window.pwned = \'img\'">',
    "<script>window.pwned = 'script'</script>",
    "<a href=\"javascript:window.pwned='link'\">link</a>",
    "<svg><g onload=\"window.pwned = 'svg'\"></g></svg>",
]
WIDE = "| " + " | ".join(f"column{i}" for i in range(30)) + " |\n|" + "---|" * 30 + "\n"
IMPORTED = {
    "type": "tandem-conversations",
    "version": 1,
    "conversations": [
        {
            "title": "<img src=x onerror=\"window.pwned='title'\">Imported",
            "leafId": "a",
            "messages": {
                "q": {"id": "q", "parentId": None, "role": "user", "content": PAYLOADS[0]},
                "a": {
                    "id": "a",
                    "parentId": "q",
                    "role": "assistant",
                    "content": "\n\n".join(
                        [
                            *PAYLOADS,
                            "```python\nprint('hello')\n```",
                            "```\n" + "x" * 400 + "\n```",
                            WIDE,
                            "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$",
                        ]
                    ),
                    "stats": {"completionTokens": 5, "finishReason": "stop", "ttft": "bad"},
                },
                "__proto__": {"id": "p", "parentId": "q", "role": "system", "content": "x"},
            },
        }
    ],
}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
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
    saved = json.dumps(SHORT_ANSWERS | (settings or {}))
    page.add_init_script(
        f"if (!localStorage.getItem('tandem.settings')) "
        f"localStorage.setItem('tandem.settings', {json.dumps(saved)});"
    )
    page.goto(url)
    expect(page.locator("#status-dot.online")).to_be_attached()
    return page


def ask(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.keyboard.press("Enter")


def answers(page: Page) -> Any:
    return page.locator(".message.assistant")


def wait_answered(page: Page, count: int = 1, timeout_s: float = 60) -> None:
    expect(page.locator(".message.assistant:not(.pending)")).to_have_count(
        count, timeout=timeout_s * 1000
    )


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


def not_pwned(page: Page) -> None:
    assert page.evaluate("window.pwned") is None
    assert not page.errors  # type: ignore[attr-defined]


def test_send_streams_an_answer_with_stats_and_survives_reload(
    cluster: Cluster, browser: Browser
) -> None:
    page = open_chat(browser, cluster.urls[0])
    expect(page.locator("#settings")).to_be_hidden()
    ask(page, "What is the capital of France?")
    expect(page.locator(".message.user .content")).to_have_text("What is the capital of France?")
    wait_answered(page)
    answer = answers(page).first
    assert answer.locator(".content").inner_text().strip()
    meta = answer.locator(".meta").inner_text()
    assert "tokens" in meta and "TTFT" in meta and ("length" in meta or "stop" in meta), meta
    expect(page.locator(".conversation-title")).to_have_text(["What is the capital of France?"])

    page.reload()
    expect(page.locator(".message.user .content")).to_have_text("What is the capital of France?")
    expect(answers(page).locator(".meta")).to_contain_text("tokens")
    expect(page.locator(".conversation-title")).to_have_count(1)
    expect(page.locator("#settings")).to_be_hidden()
    page.click("#toggle-settings")
    expect(page.locator("#settings")).to_be_visible()
    expect(page.locator("#max-tokens")).to_have_value("6")  # saved settings came back
    page.keyboard.press("Escape")
    expect(page.locator("#settings")).to_be_hidden()
    not_pwned(page)
    page.context.close()


def test_escape_stops_an_answer_and_the_engine_frees_it(cluster: Cluster, browser: Browser) -> None:
    page = open_chat(browser, cluster.urls[0], {"maxTokens": "2000"})
    ask(page, "Tell me a long story about a dragon.")
    expect(page.locator("#stop")).to_be_visible()
    expect(answers(page).locator(".content")).not_to_have_text("", timeout=60_000)
    page.keyboard.press("Escape")
    wait_answered(page)
    expect(page.locator("#stop")).to_be_hidden()
    expect(answers(page).locator(".meta")).to_contain_text("stopped")
    wait_idle(cluster.urls[0])
    page.context.close()


def test_regenerate_and_edit_make_branches(cluster: Cluster, browser: Browser) -> None:
    page = open_chat(browser, cluster.urls[0])
    ask(page, "Say hello.")
    wait_answered(page)
    page.get_by_role("button", name="Regenerate answer").click()
    wait_answered(page)
    expect(answers(page)).to_have_count(1)  # the new answer replaces the shown one
    expect(answers(page).locator(".branch-position")).to_have_text("2/2")
    answers(page).get_by_role("button", name="Previous version").click()
    expect(answers(page).locator(".branch-position")).to_have_text("1/2")

    page.get_by_role("button", name="Edit and resend").click()
    page.fill(".edit-field", "Say goodbye.")
    page.keyboard.press("Enter")
    wait_answered(page)
    question = page.locator(".message.user")
    expect(question.locator(".content")).to_have_text("Say goodbye.")
    expect(question.locator(".branch-position")).to_have_text("2/2")
    question.get_by_role("button", name="Previous version").click()
    expect(question.locator(".content")).to_have_text("Say hello.")
    expect(answers(page).locator(".branch-position")).to_have_text("2/2")  # its latest answer
    page.reload()
    expect(page.locator(".message.user .content")).to_have_text("Say hello.")
    page.context.close()


def test_model_output_renders_code_and_stays_inert(cluster: Cluster, browser: Browser) -> None:
    page = open_chat(browser, cluster.urls[0])
    force_answer(page, '<img src=x onerror="pwned=1">\n\n```py\nx=1\n```')
    ask(page, "Show me.")
    wait_answered(page, timeout_s=180)  # ~20 tokens, each through the grammar
    answer = answers(page).first
    expect(answer.locator("pre > code")).to_have_text("x=1")
    expect(answer.locator(".code-lang")).to_have_text("py")
    expect(answer.get_by_role("button", name="Copy py code")).to_be_visible()
    assert answer.locator("img").count() == 1
    assert answer.locator("img").get_attribute("onerror") is None
    page.wait_for_timeout(300)  # an image error handler would have run by now
    not_pwned(page)
    page.context.close()


def test_imported_conversation_is_sanitized_and_fits_a_phone(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    page = open_chat(browser, cluster.urls[0], viewport={"width": 390, "height": 844})
    exported = tmp_path / "chats.json"
    exported.write_text(json.dumps(IMPORTED))
    page.click("#toggle-sidebar")
    page.set_input_files("#import-file", str(exported))
    expect(page.locator("#import-status")).to_have_text("Imported 1 conversation.")
    page.keyboard.press("Escape")  # closes the conversation list
    answer = answers(page).first
    expect(answer.locator(".code-block pre > code")).to_have_count(2)
    expect(answer.locator(".code-lang").first).to_have_text("python")
    expect(answer.locator(".katex")).not_to_have_count(0)
    expect(answer.locator("script")).to_have_count(0)
    assert answer.locator("[onerror], [onload]").count() == 0
    assert answer.locator("a[href^='javascript']").count() == 0
    # The user's own words show as text: the payload is visible, not an element.
    expect(page.locator(".message.user .content")).to_have_text(PAYLOADS[0])
    assert page.locator(".message.user img").count() == 0
    expect(answer.locator(".meta")).to_have_text("5 tokens · stop")
    page.wait_for_timeout(300)
    not_pwned(page)

    # 390 px wide: long code and wide tables scroll in their boxes, the page does not.
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, width
    overflow = page.evaluate(
        "(() => { const c = document.querySelector('#conversation');"
        " return c.scrollWidth - c.clientWidth; })()"
    )
    assert overflow <= 0, overflow
    page.click("#toggle-sidebar")
    expect(page.locator(".conversation-title")).to_contain_text(["Imported"])
    assert page.locator(".conversation-title img").count() == 0
    page.context.close()


STREAMED = (
    "# Title\n\n[ref]: https://example.com\n\n"
    "Some *text* with $x^2$ math\nand [a link][ref].\n\n- one\n- two\n\n"
    "```python\nprint('hi')\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
    "> a quote\n\nThe end."
)


def test_streamed_markdown_renders_as_the_whole_text(cluster: Cluster, browser: Browser) -> None:
    """Fed a few characters at a time, the streaming renderer ends with the same elements
    and text as rendering the whole answer at once, and keeps finished blocks' nodes."""
    page = open_chat(browser, cluster.urls[0])
    result = page.evaluate(
        """async (text) => {
            const { StreamingMarkdown, renderMarkdown } = await import("/static/js/markdown.js");
            const streamed = document.createElement("div");
            const stream = new StreamingMarkdown(streamed);
            let heading = null, sameHeading = true;
            for (let end = 3; end < text.length + 3; end += 3) {
                stream.update(text.slice(0, end));
                stream.finish();
                // Once finished, the heading is a child of the container, out of the open block.
                const finished = streamed.querySelector(":scope > h1");
                heading ??= finished;
                if (heading) sameHeading &&= finished === heading;
            }
            const whole = document.createElement("div");
            whole.append(renderMarkdown(text));
            const shape = (root) => [...root.querySelectorAll("*")]
                .filter((node) => !node.classList.contains("open-block"))
                .map((node) => node.tagName).join(" ");
            return { streamed: shape(streamed), whole: shape(whole),
                     sameHeading: sameHeading && heading !== null,
                     texts: [streamed.textContent, whole.textContent] };
        }""",
        STREAMED,
    )
    assert result["streamed"] == result["whole"]
    assert result["texts"][0] == result["texts"][1]
    assert result["sameHeading"]  # a finished block's DOM is never rebuilt
    page.context.close()


def test_engine_panel_shows_the_live_engine(cluster: Cluster, browser: Browser) -> None:
    page = open_chat(browser, cluster.urls[0], viewport={"width": 1280, "height": 800})
    expect(page.locator("#engine-panel")).to_be_visible()
    expect(page.locator("#stat-servers")).to_have_text("2")  # the cluster's two servers
    expect(page.locator("#stat-kv")).to_contain_text("%")
    expect(page.locator("#stat-generation")).to_contain_text("tok/s", timeout=5_000)
    points = page.locator("#sparkline-generation").get_attribute("points") or ""
    assert points.strip(), "no sparkline"
    page.click("#toggle-engine")
    expect(page.locator("#engine-panel")).to_be_hidden()
    page.context.close()


def test_stats_route_and_model_defaults(cluster: Cluster) -> None:
    stats = httpx.get(f"{cluster.urls[1]}/stats").json()
    assert stats["num_connected_servers"] == 2
    assert 0 <= stats["kv_cache_usage"] <= 1 and 0 <= stats["prefix_cache_hit_rate"] <= 1
    card = httpx.get(f"{cluster.urls[0]}/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {}  # the default GGUF model sets none
