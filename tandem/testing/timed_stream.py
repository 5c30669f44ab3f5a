"""One streamed completion timed from the client's side, on a bare asyncio connection.

A load generator's own work must not be what it measures: through httpx, a client process
spends about a millisecond of Python on each request and each chunk, and at a GPU's rates
(hundreds of streams a second, each a chunk per token) its event loop falls behind and adds
its lag to every time it takes. Here a request is one write and its answer is read as bytes,
a JSON parse per event: HTTP/1.1 on a connection of its own, closed after it, the answer's
body chunked (as a server streams it) or not (a refusal).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class TimedStream:
    status: int  # 599: the stream ended with an error event
    first: float  # seconds to the first event (to the answer, when it is not 200)
    text: str
    took: float  # seconds to its end


async def timed_stream(url: str, body: dict[str, Any]) -> TimedStream:
    """POST ``body`` with ``stream`` to ``url``/v1/completions; the clock starts before the
    connection is made."""
    started = time.monotonic()
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        payload = json.dumps({**body, "stream": True}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        writer.write(head.encode() + payload)
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"transfer-encoding":
                chunked = value.strip().lower() == b"chunked"
        if status != 200:
            await reader.read()
            took = time.monotonic() - started
            return TimedStream(status, took, "", took)
        first = 0.0
        text = ""
        pending = b""
        async for data in _body(reader, chunked):
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    took = time.monotonic() - started
                    return TimedStream(599, first or took, text, took)
                if not first:
                    first = time.monotonic() - started
                text += chunk["choices"][0]["text"]
        took = time.monotonic() - started
        # The server closes first (Connection: close), so that the TIME_WAIT is its own:
        # a client closing first holds an ephemeral port a minute for each request, and
        # a GPU's overload run sends tens of thousands in that time.
        await reader.read()
        return TimedStream(200, first, text, took)
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The body's bytes as they come: the chunks' data, or whatever arrives until the end."""
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if not size:
            return
        yield (await reader.readexactly(size + 2))[:-2]
