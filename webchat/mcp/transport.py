"""The two ways to a server, as the SDK's `Transport` (a context manager yielding its message streams), and Link:
what one connection attempt's transport saw (why it closed, the process's exit and last stderr lines).

Streamable HTTP is the SDK's `streamable_http_client` on an httpx2 client carrying the config's headers. One message
from the server is at most MAX_MESSAGE_BYTES: an SSE event by the SDK's own `max_sse_event_size`, a JSON answer (the
SDK reads it whole, without a limit; a 2026 server answers a quick request so) by CappedTransport here. Answers are
asked for uncompressed and a compressed JSON answer is refused: a small body could expand without bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import httpx2
from mcp.client.streamable_http import streamable_http_client

from webchat.mcp.config import HttpServer

if TYPE_CHECKING:
    from mcp.client._transport import TransportStreams  # the SDK's name for a transport's stream pair (no public one)

MAX_MESSAGE_BYTES = 16 << 20  # one message from a server, on either transport
TOO_LARGE = f"longer than {MAX_MESSAGE_BYTES:,} bytes"  # in the error the SDK gives the request it ended
HTTP_TIMEOUT = httpx2.Timeout(30.0, read=300.0)  # the SDK's own: a response stream may stay open for minutes


@dataclass
class Link:
    """What one connection attempt's transport saw; `poke` wakes the connection's watcher when it closes."""

    poke: Callable[[], None]
    closed: str = ""  # why the stream from the server ended, when it did ("" while it is open)
    too_large: bool = False  # it ended because one message was past MAX_MESSAGE_BYTES
    returncode: int | None = None  # a stdio server's exit status, once it is known
    stderr: str = ""  # a stdio server's last stderr lines

    def close(self, reason: str, too_large: bool = False) -> None:
        """Record the first reason the stream ended and wake the watcher."""
        if not self.closed:
            self.closed, self.too_large = reason, too_large
        self.poke()

    def epilogue(self) -> str:
        """The process's exit and its last stderr lines, for a status message ('' for HTTP or when there is none)."""
        parts = []
        if self.returncode is not None:
            parts.append(f"exited with status {self.returncode}")
        if self.stderr:
            parts.append(f"its last output: {self.stderr}")
        return "; ".join(parts)


@asynccontextmanager
async def http_transport(server: HttpServer) -> AsyncIterator[TransportStreams]:
    """The SDK's streamable HTTP transport to `server.url`, every request with `server.headers`."""
    headers = {**server.headers, "Accept-Encoding": "identity"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=HTTP_TIMEOUT, transport=CappedTransport()) as http,
        streamable_http_client(server.url, http_client=http, max_sse_event_size=MAX_MESSAGE_BYTES) as streams,
    ):
        yield streams


class BodyRefused(httpx2.StreamError):
    """A JSON answer cut off: longer than MAX_MESSAGE_BYTES, or compressed (the SDK fails its request with this)."""


class CappedTransport(httpx2.AsyncBaseTransport):
    """httpx2's own transport, with each JSON answer's body refused past MAX_MESSAGE_BYTES or when compressed."""

    def __init__(self) -> None:
        self._inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if not response.headers.get("content-type", "").lower().startswith("application/json"):
            return response  # SSE: the SDK's per-event limit; anything else the SDK never reads
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        encoding = response.headers.get("content-encoding", "identity").lower()
        return httpx2.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                               stream=CappedStream(response.stream, encoding))

    async def aclose(self) -> None:
        await self._inner.aclose()


class CappedStream(httpx2.AsyncByteStream):
    """A response body that raises BodyRefused once past MAX_MESSAGE_BYTES (or at once when compressed)."""

    def __init__(self, inner: httpx2.AsyncByteStream, encoding: str) -> None:
        self._inner, self._encoding = inner, encoding

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._encoding != "identity":
            raise BodyRefused(f"a compressed answer ({self._encoding}), which was not asked for")
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > MAX_MESSAGE_BYTES:
                raise BodyRefused(f"an answer {TOO_LARGE}")
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def display_url(url: str) -> str:
    """The URL as messages show it: scheme, host, port and path (a query may hold a key)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
