"""Refusing at the door: while the engine's queue is full, a request for generation or
embeddings gets its HTTP 429 before this server reads its body.

The engine's refusal (``overloaded``, past ``--max-queued-requests``) is authoritative, but it
comes after the server has parsed the body, rendered the chat template and tokenized the
prompt, and after the engine's step under way ends: under load, hundreds of milliseconds of
work for nothing, taken from the requests being served. The engine sends its stats the moment
its queue fills or frees (engine/service/admission.py), so while its last stats say full the
server answers 429 itself, at once, with the same body and ``Retry-After``; a request that
slips through in the step after a place frees is refused by the engine as before.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from server.engine_pool import EnginePool
from server.generation import overloaded

# The routes that put requests in the engine's queue (embeddings are refused alike there).
GATED_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"}
)


class AdmissionGate:
    """ASGI middleware: 429 for the gated routes while every engine replica's queue is full."""

    def __init__(self, app: ASGIApp, pool: EnginePool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GATED_PATHS
            and self.pool.queue_full
        ):
            error = overloaded(
                "the engine's queue is full (--max-queued-requests or --max-queued-prompt-tokens)"
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
