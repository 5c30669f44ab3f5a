"""The web chat on a phone (390x844) and a tablet (768x1024), light and dark: the side panels
are drawers over the chat that close with their button, Esc and a click beside them; every
button is a target of at least 24x24 px (WCAG 2.5.8); the model's name shows; nothing
scrolls sideways."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.conftest import Cluster
from tests.e2e.web_chat_page import chromium, import_file, not_pwned, open_chat

# A conversation with every kind of button a message has: copy, edit, regenerate, continue,
# versions, a code block's copy and a remote image's placeholder.
EXAMPLE = {
    "type": "tandem-conversations",
    "conversations": [
        {
            "title": "Layout",
            "leafId": "a2",
            "messages": {
                "q": {"id": "q", "parentId": None, "role": "user", "content": "Show me."},
                "a1": {"id": "a1", "parentId": "q", "role": "assistant", "content": "One."},
                "a2": {
                    "id": "a2",
                    "parentId": "q",
                    "role": "assistant",
                    "content": "```python\nprint(1)\n```\n\n![i](https://images.test/i.png)",
                    "stats": {"completionTokens": 9, "finishReason": "length"},
                },
            },
        }
    ],
}
BACKGROUND = {"light": "rgb(247, 247, 245)", "dark": "rgb(21, 21, 23)"}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


def assert_targets_fit(page: Page, state: str) -> None:
    small = page.evaluate(
        """() => [...document.querySelectorAll("button")]
            .filter((button) => button.checkVisibility())
            .map((button) => [button.getAttribute("aria-label") || button.textContent,
                              button.getBoundingClientRect()])
            .filter(([, box]) => box.width < 24 || box.height < 24)
            .map(([name, box]) => `${name}: ${box.width}x${box.height}`)"""
    )
    assert small == [], f"{state}: {small}"
    assert page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]


def assert_drawer(page: Page, toggle: str, drawer: str, close: str) -> None:
    """Opens over the chat (beside the scrim), and closes by its button, Esc and the scrim."""
    page.click(toggle)
    expect(page.locator(drawer)).to_be_visible()
    expect(page.locator("#scrim")).to_be_visible()
    assert_targets_fit(page, f"{drawer} open")
    chat = page.locator(".chat").bounding_box()
    box = page.locator(drawer).bounding_box()
    assert (
        chat
        and box
        and box["x"] < chat["x"] + chat["width"]
        and box["x"] + box["width"] > chat["x"]
    )
    page.click(close)
    expect(page.locator(drawer)).to_be_hidden()
    expect(page.locator("#scrim")).to_be_hidden()
    expect(page.locator(toggle)).to_be_focused()
    page.click(toggle)
    page.keyboard.press("Escape")
    expect(page.locator(drawer)).to_be_hidden()
    page.click(toggle)
    page.locator("#scrim").click(position={"x": 10 if drawer == "#engine-panel" else 370, "y": 400})
    expect(page.locator(drawer)).to_be_hidden()


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("size", [(390, 844), (768, 1024)], ids=["phone", "tablet"])
def test_drawers_targets_and_model_name(
    cluster: Cluster, browser: Browser, tmp_path: Path, scheme: str, size: tuple[int, int]
) -> None:
    width, height = size
    page = open_chat(
        browser, cluster.urls[0], viewport={"width": width, "height": height}, color_scheme=scheme
    )
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == BACKGROUND[scheme]
    model = page.locator("#model-name")
    expect(model).to_contain_text(cluster.model)
    box = model.bounding_box()
    assert box and box["width"] >= 100 and box["x"] + box["width"] <= width, box
    expect(page.locator("#sidebar")).to_be_hidden()  # drawers start closed
    expect(page.locator("#engine-panel")).to_be_hidden()

    import_file(page, tmp_path / "layout.json", EXAMPLE)
    page.keyboard.press("Escape")  # closes the conversation list
    expect(page.locator("#sidebar")).to_be_hidden()
    expect(page.get_by_role("button", name="Continue the answer")).to_be_visible()
    assert_targets_fit(page, "chat")
    page.click("#toggle-settings")
    assert_targets_fit(page, "settings open")
    page.keyboard.press("Escape")
    expect(page.locator("#settings")).to_be_hidden()

    assert_drawer(page, "#toggle-sidebar", "#sidebar", "#close-sidebar")
    assert_drawer(page, "#toggle-engine", "#engine-panel", "#close-engine")
    # One drawer at a time: opening the engine panel closes the conversation list.
    page.click("#toggle-sidebar")
    page.click("#toggle-engine")
    expect(page.locator("#engine-panel")).to_be_visible()
    expect(page.locator("#sidebar")).to_be_hidden()
    not_pwned(page)
    page.context.close()
