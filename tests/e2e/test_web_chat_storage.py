"""The web chat's conversations in IndexedDB: the ones an older page kept in localStorage move
there once, and a full storage is said plainly while the chat goes on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect

from tests.conftest import Cluster
from tests.e2e.web_chat_page import (
    answers,
    ask,
    chromium,
    not_pwned,
    open_chat,
    wait_answered,
    wait_saved,
)

# A conversation as the localStorage page saved it (no attachments, formats or tool fields).
LEGACY = {
    "id": "legacy-1",
    "title": "From localStorage",
    "createdAt": 1_700_000_000_000,
    "updatedAt": 1_700_000_000_000,
    "rootIds": ["q"],
    "leafId": "a",
    "messages": {
        "q": {
            "id": "q",
            "parentId": None,
            "childIds": ["a"],
            "role": "user",
            "content": "Old question",
            "reasoning": "",
            "toolCalls": [],
            "stats": None,
            "error": None,
            "createdAt": 1_700_000_000_000,
        },
        "a": {
            "id": "a",
            "parentId": "q",
            "childIds": [],
            "role": "assistant",
            "content": "Old **answer**",
            "reasoning": "",
            "toolCalls": [],
            "stats": {"completionTokens": 3, "finishReason": "stop"},
            "error": None,
            "createdAt": 1_700_000_000_000,
        },
    },
}
STORED_IDS = """async () => {
    const db = await new Promise((resolve, reject) => {
        const opening = indexedDB.open("tandem");
        opening.onsuccess = () => resolve(opening.result);
        opening.onerror = () => reject(opening.error);
    });
    const keys = await new Promise((resolve) => {
        const request = db.transaction("conversations").objectStore("conversations").getAllKeys();
        request.onsuccess = () => resolve(request.result);
    });
    db.close();
    return keys;
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


def test_localstorage_conversations_move_to_indexeddb_once(
    cluster: Cluster, browser: Browser
) -> None:
    page = open_chat(browser, cluster.urls[0])
    page.evaluate(
        "(legacy) => { localStorage.setItem('tandem.conversation.legacy-1', legacy);"
        " localStorage.setItem('tandem.current', 'legacy-1'); }",
        json.dumps(LEGACY),
    )
    wait_saved(page)
    page.reload()
    expect(page.locator(".message.user .content")).to_have_text("Old question")
    expect(answers(page).locator("strong")).to_have_text("answer")
    expect(answers(page).locator(".meta")).to_have_text("3 tokens · stop")
    assert page.evaluate(STORED_IDS) == ["legacy-1"]
    assert (
        page.evaluate("Object.keys(localStorage).filter((k) => k.startsWith('tandem.conv'))") == []
    )
    # Asked again, it is saved where it now lives; a reload finds it once, with the answer.
    ask(page, "And now?")
    wait_answered(page, 2)
    wait_saved(page)
    page.reload()
    expect(page.locator(".conversation-title")).to_have_text(["From localStorage"])
    expect(answers(page)).to_have_count(2)
    not_pwned(page)
    page.context.close()


def test_full_storage_is_said_plainly_and_the_chat_goes_on(
    cluster: Cluster, browser: Browser
) -> None:
    """The origin's quota set to what it already uses (chromium's DevTools protocol), so that
    every save fails as on a full disk: the page says the storage is full while the answer
    streams to its end, and the next question is answered too, the page never stuck on Stop."""
    page = open_chat(browser, cluster.urls[0])
    used = page.evaluate("navigator.storage.estimate()")["usage"]
    devtools = page.context.new_cdp_session(page)
    devtools.send("Storage.overrideQuotaForOrigin", {"origin": cluster.urls[0], "quotaSize": used})
    ask(page, "Hello?")
    notice = page.locator("#notice")
    expect(notice).to_be_visible()  # the first save, with the question, already failed
    expect(notice).to_contain_text("storage for this site is full")
    expect(notice).to_contain_text("export and delete old conversations")
    wait_answered(page)
    expect(answers(page).locator(".meta")).to_contain_text("tokens")
    expect(page.locator("#stop")).to_be_hidden()
    page.click("#close-notice")
    expect(notice).to_be_hidden()
    ask(page, "Still there?")
    wait_answered(page, 2)
    expect(answers(page).nth(1).locator(".meta")).to_contain_text("tokens")
    expect(notice).to_be_visible()
    not_pwned(page)
    page.context.close()
