"""The web chat in a real browser (Debian's chromium, driven by playwright) against the real
engine and servers of the `cluster` fixture: what a person does. Its safety, storage, layout
and llama.cpp-parity tests are in the test_web_chat_*.py modules beside it.

Answers are kept to a few tokens (the page's max-tokens setting), and the modules share the
session's cluster and one browser each, so that they stay short on a CPU. Where a test needs
a given answer, it asks the engine for exactly that text through a structured-output choice
added to the page's request in flight (the model still writes it, token by token); renderer
checks that need no engine go through the page's own import path.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, expect

from tandem.testing.processes import free_port, start_server, stop
from tests.conftest import Cluster
from tests.e2e.web_chat_page import (
    answers,
    ask,
    chat_requests,
    chromium,
    import_file,
    not_pwned,
    open_chat,
    wait_answered,
    wait_idle,
    wait_saved,
)

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
    with chromium() as browser:
        yield browser


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

    wait_saved(page)
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
    # How often the page marked itself saving: what wait_saved waits out before a reload.
    page.evaluate(
        "window.savingMarks = 0; new MutationObserver(() => {"
        " if (document.documentElement.hasAttribute('data-saving')) window.savingMarks++; })"
        ".observe(document.documentElement, {attributes: true, attributeFilter: ['data-saving']})"
    )
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
    wait_saved(page)
    assert page.evaluate("window.savingMarks") > 0
    page.reload()
    expect(page.locator(".message.user .content")).to_have_text("Say hello.")
    page.context.close()


def test_imported_conversation_is_sanitized_and_fits_a_phone(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    page = open_chat(browser, cluster.urls[0], viewport={"width": 390, "height": 844})
    import_file(page, tmp_path / "chats.json", IMPORTED)
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


def test_answers_stream_on_in_their_conversation_while_another_is_open(
    cluster: Cluster, browser: Browser
) -> None:
    """Starting a new chat, asking there and opening the first one again leave the first
    answer streaming: it ends in its own conversation, whole, at its token limit."""
    page = open_chat(browser, cluster.urls[0], {"maxTokens": "12"})
    ask(page, "Tell me a story about a dragon.")
    first = answers(page).locator(".content")
    expect(first).not_to_have_text("", timeout=60_000)
    page.keyboard.press("Control+Shift+O")  # a new chat while the answer streams
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#send")).to_be_visible()  # this conversation has nothing streaming
    expect(page.locator(".conversation-title.streaming")).to_have_count(1)
    ask(page, "Say hello.")
    wait_answered(page, timeout_s=120)  # beside the first answer, which still streams
    page.get_by_role("button", name="Tell me a story about a dragon.", exact=True).click()
    expect(page.locator(".message.user .content")).to_have_text("Tell me a story about a dragon.")
    wait_answered(page, timeout_s=120)
    meta = answers(page).locator(".meta")
    expect(meta).to_contain_text("12 tokens")
    expect(meta).to_contain_text("length")
    expect(page.locator(".conversation-title.streaming")).to_have_count(0)
    wait_saved(page)
    page.reload()  # both were saved whole
    expect(answers(page).locator(".meta")).to_contain_text("12 tokens")
    expect(page.locator(".conversation-title")).to_have_count(2)
    not_pwned(page)
    page.context.close()


LONG_PASTE = "\n".join(f"line {i}: " + "x" * 60 for i in range(300))  # 21,189 characters


def test_long_paste_json_answers_and_imported_times(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    """A long question shows folded; a JSON-mode answer as indented JSON; imported chats sort
    among the others by their own times (ISO strings or numbers), not by the import's."""
    page = open_chat(browser, cluster.urls[0])
    ask(page, "Hi.")
    wait_answered(page)
    day = 86_400_000
    import_file(
        page,
        tmp_path / "chats.json",
        {
            "type": "tandem-conversations",
            "conversations": [
                {
                    "title": "Old paste",
                    "updatedAt": "2020-01-02T03:04:05Z",
                    "messages": [
                        {"role": "user", "content": LONG_PASTE},
                        {"role": "assistant", "content": '{"a":1,"b":[2,3]}', "format": "json"},
                    ],
                },
                {
                    "title": "Last year",
                    "messages": {
                        "q": {"id": "q", "parentId": None, "role": "user", "content": "x"},
                        "a": {
                            "id": "a",
                            "parentId": "q",
                            "role": "assistant",
                            "content": "y",
                            "createdAt": 1_700_000_000_000 + day,
                        },
                    },
                    "leafId": "a",
                },
            ],
        },
    )
    expect(page.locator(".conversation-title")).to_have_text(["Hi.", "Last year", "Old paste"])
    page.get_by_role("button", name="Old paste", exact=True).click()
    question = page.locator(".message.user .content")
    expect(question).to_have_class("content folded")
    box = question.bounding_box()
    assert box and box["height"] < 300, box
    toggle = page.get_by_role("button", name=f"Show all ({len(LONG_PASTE):,} characters)")
    toggle.click()
    box = question.bounding_box()
    assert box and box["height"] > 2000, box
    expect(page.get_by_role("button", name="Show less")).to_be_visible()
    code = answers(page).locator("pre > code")
    expect(code).to_have_text('{\n  "a": 1,\n  "b": [\n    2,\n    3\n  ]\n}')
    expect(answers(page).locator(".code-lang")).to_have_text("json")

    # A JSON-mode answer of the engine's: asked as json_object, shown as a JSON code block.
    sent = chat_requests(page)
    page.click("#toggle-settings")
    page.check("#json-mode")
    page.keyboard.press("Escape")
    page.keyboard.press("Control+Shift+O")
    ask(page, "A JSON object with a name.")
    wait_answered(page)
    assert sent[-1]["response_format"] == {"type": "json_object"}
    expect(answers(page).locator(".code-lang")).to_have_text("json")
    assert answers(page).locator("pre > code").inner_text().startswith("{")
    not_pwned(page)
    page.context.close()


def test_a_server_that_dies_mid_answer_is_named(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    """Its own server, killed while an answer streams: the answer says the connection to
    the server was lost (not "network error"), the page can send again, and the top bar
    says the server does not answer."""
    port = free_port()
    server = start_server(cluster.engine_address, port, tmp_path / "server.log")
    try:
        page = open_chat(browser, f"http://127.0.0.1:{port}", {"maxTokens": "2000"})
        ask(page, "Tell me a long story about a dragon.")
        expect(answers(page).locator(".content")).not_to_have_text("", timeout=60_000)
        stop(server, signal.SIGKILL)
        wait_answered(page)
        meta = answers(page).locator(".meta")
        expect(meta).to_have_class("meta error")
        expect(meta).to_contain_text(f"connection to the server at 127.0.0.1:{port} was lost")
        assert answers(page).locator(".content").inner_text().strip()  # what came is kept
        expect(page.locator("#send")).to_be_visible()
        expect(page.locator("#engine-state")).to_have_text("server not answering", timeout=10_000)
        ask(page, "Are you there?")
        wait_answered(page, 2)
        expect(answers(page).nth(1).locator(".meta")).to_contain_text("does not answer")
        page.context.close()
    finally:
        stop(server, signal.SIGKILL)
    wait_idle(cluster.urls[0])
