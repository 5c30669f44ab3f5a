"""Streamed completions sent to several servers as a load balancer sends them: for the
rolling-restart tests and scripts/soak.py.

A refused connection, a connection closed before any response, or a 503 from a draining
server (``server_draining``) never reached the engine, so it is retried on the next server,
as a load balancer that follows /health does; anything else that goes wrong once a server
has answered 200 is the stream's error, never retried.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

_MAX_ATTEMPTS = 50
_RETRY_PAUSE_S = 0.05


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # the stream ended with [DONE]
    error: str | None = None
    retries: int = 0  # refusals retried on another server
    server: str = ""
    events: int = 0  # text events read
    answered: bool = False  # a server answered 200: from then on nothing is retried
    # The usage chunk's count, when the body asked for it (stream_options.include_usage).
    completion_tokens: int | None = None


@dataclass
class Balancer:
    """Sends each stream to ``urls[start]`` first, then the next server, and so on."""

    client: httpx.AsyncClient
    urls: list[str]
    retries: int = field(default=0)
    answered: int = field(default=0)  # streams a server answered 200

    async def stream(
        self, body: dict[str, Any], start: int, disconnect_after: int | None = None
    ) -> StreamResult:
        """POST /v1/completions with ``stream``; with ``disconnect_after``, the client goes
        away after that many text events."""
        result = StreamResult()
        for attempt in range(_MAX_ATTEMPTS):
            result.server = self.urls[(start + attempt) % len(self.urls)]
            try:
                if await self._attempt(result, body, disconnect_after):
                    return result
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if result.answered:
                    result.error = f"stream cut: {exc!r}"
                    return result
            result.retries += 1
            self.retries += 1
            await asyncio.sleep(_RETRY_PAUSE_S)
        result.error = f"refused {_MAX_ATTEMPTS} times"
        return result

    async def _attempt(
        self, result: StreamResult, body: dict[str, Any], disconnect_after: int | None
    ) -> bool:
        """One try; False if it was refused before reaching the engine."""
        request = {**body, "stream": True}
        url = f"{result.server}/v1/completions"
        async with self.client.stream("POST", url, json=request) as response:
            if response.status_code != 200:
                error = json.loads(await response.aread()).get("error", {})
                if response.status_code == 503 and error.get("code") == "server_draining":
                    return False
                result.error = f"HTTP {response.status_code}: {error}"
                return True
            result.answered = True
            self.answered += 1
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    result.done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {chunk['error']}"
                    continue
                if not chunk["choices"]:  # the usage chunk
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                    continue
                choice = chunk["choices"][0]
                result.text += choice["text"]
                result.finish_reason = choice["finish_reason"] or result.finish_reason
                result.events += 1
                if disconnect_after is not None and result.events >= disconnect_after:
                    return True  # leaving the block closes the connection
        if not result.done and result.error is None:
            result.error = "the stream ended without [DONE]"
        return True
