"""The web chat's files (frontend/): the page at ``/`` and its assets under ``/static``, each
sent with a strict Content-Security-Policy.

The page renders text written by a model or read from an imported file. Its sanitizer
(frontend/js/markdown.js) is the first wall; the policy is the second, so that whatever slips
past it still cannot run a script, load a style sheet or font from elsewhere, frame the page,
or send a form:

- scripts, styles, fonts, fetches and the manifest come from this server alone, and no
  inline script or style element runs (the page has none: ``script-src 'self'`` without
  ``'unsafe-inline'``);
- images may come from this server, ``data:`` URLs, or any ``https:`` host. The page keeps
  remote images out until the user allows them for one conversation (the sanitizer strips
  their addresses, a click-to-load placeholder stands in); a policy is fixed for the page's
  life, so allowing them in one conversation cannot loosen it then, which is why it lets
  ``https:`` in for all and the page decides which. Plain ``http:`` images never load.
"""

from __future__ import annotations

from pathlib import Path

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route, request_response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

FRONTEND_DIR = Path(__file__).resolve().parent.parent / "frontend"

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: https:",
        "font-src 'self'",
        "connect-src 'self'",
        "manifest-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    # A link or an allowed image does not tell its host which page it came from.
    "referrer-policy": "no-referrer",
}


class WithSecurityHeaders:
    """An ASGI app that sends ``app``'s responses with ``SECURITY_HEADERS``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _index(request: Request) -> Response:
    return FileResponse(FRONTEND_DIR / "index.html")


def web_ui_routes() -> list[BaseRoute]:
    """The routes of the page and its files."""
    return [
        Route("/", WithSecurityHeaders(request_response(_index)), methods=["GET"]),
        Mount("/static", WithSecurityHeaders(StaticFiles(directory=FRONTEND_DIR)), name="static"),
    ]
