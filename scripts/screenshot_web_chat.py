"""Screenshots of the web chat for docs/: light and dark, desktop and phone.

Against a running server (`scripts/start_distributed.sh`, then this script): each shot
imports the same example conversation (markdown, code, a table, math) through the page's
import button, then asks the model a real question, so the last answer and its stats are
the engine's. Drives Debian's chromium (`apt-get install chromium`) with playwright.

    python scripts/screenshot_web_chat.py --url http://127.0.0.1:8000 --out docs
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from playwright.sync_api import Browser, expect, sync_playwright

EXAMPLE = {
    "type": "tandem-conversations",
    "version": 1,
    "conversations": [
        {
            "title": "Primes in Python",
            "messages": [
                {"role": "user", "content": "A Python function listing the primes below n?"},
                {
                    "role": "assistant",
                    "content": (
                        "A sieve of Eratosthenes does it in $O(n \\log \\log n)$:\n\n"
                        "```python\ndef primes_below(n: int) -> list[int]:\n"
                        "    sieve = [True] * n\n"
                        "    for i in range(2, int(n**0.5) + 1):\n"
                        "        if sieve[i]:\n"
                        "            sieve[i * i :: i] = [False] * len(sieve[i * i :: i])\n"
                        "    return [i for i in range(2, n) if sieve[i]]\n```\n\n"
                        "| n | primes below n |\n|---|---|\n| 10 | 2, 3, 5, 7 |\n"
                        "| 20 | 2, 3, 5, 7, 11, 13, 17, 19 |\n"
                    ),
                    "stats": {
                        "completionTokens": 131,
                        "tokensPerSecond": 48.2,
                        "ttft": 0.09,
                        "finishReason": "stop",
                    },
                },
            ],
        }
    ],
}
SHOTS = {  # name: (viewport, device scale)
    "desktop": ({"width": 1280, "height": 760}, 1),
    "phone": ({"width": 390, "height": 760}, 1),
}


def shoot(browser: Browser, url: str, example: Path, out: Path, scheme: str, name: str) -> Path:
    viewport, scale = SHOTS[name]
    context = browser.new_context(viewport=viewport, device_scale_factor=scale, color_scheme=scheme)
    page = context.new_page()
    # The engine panel beside the chat on a desktop; on a phone it would cover the chat.
    panel = "hidden" if name == "phone" else "shown"
    page.add_init_script(
        "localStorage.setItem('tandem.settings', JSON.stringify({maxTokens: '40'}));"
        f"localStorage.setItem('tandem.enginePanel', '{panel}');"
    )
    page.goto(url)
    expect(page.locator("#status-dot.online")).to_be_attached(timeout=30_000)
    if name == "phone":
        page.click("#toggle-sidebar")
    page.set_input_files("#import-file", str(example))
    expect(page.locator(".message.assistant")).to_have_count(1)
    if name == "phone":
        page.keyboard.press("Escape")  # closes the conversation list
    page.fill("#input", "What is the capital of France?")
    page.keyboard.press("Enter")
    expect(page.locator(".message.assistant:not(.pending)")).to_have_count(2, timeout=300_000)
    page.wait_for_timeout(1500)  # two stats polls: the panel's rates and sparkline
    path = out / f"web-chat-{scheme}-{name}.png"
    page.screenshot(path=str(path))
    context.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, sync_playwright() as playwright:
        example = Path(scratch) / "example.json"
        example.write_text(json.dumps(EXAMPLE))
        browser = playwright.chromium.launch(executable_path=args.chromium)
        for scheme in ("light", "dark"):
            for name in SHOTS:
                path = shoot(browser, args.url, example, args.out, scheme, name)
                print(f"{path}: {path.stat().st_size // 1024} KiB")
        browser.close()


if __name__ == "__main__":
    main()
