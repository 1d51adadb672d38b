"""The upstream's HTTP client (httpx, async): JSON calls and the chat stream as decoded `data:` objects.

Leaving `stream` early (a Stop, a disconnect, an error) closes its response, and with it the TCP connection:
that close is what vLLM, SGLang, llama.cpp's server and webchat take as the client gone, and abort on.
Every failure is an UpstreamError whose message names the upstream (its URL, never its key).

The upstream is untrusted input (issue 42): a stream's line is at most MAX_LINE_BYTES, its body MAX_STREAM_BYTES,
and each `data:` event must complete within `timeout` of the one before (bytes that trickle in do not count); a
JSON answer is at most MAX_JSON_BYTES and done within twice `timeout`; of an error's body MAX_ERROR_BYTES are read.
Replies are asked for uncompressed (a compressed one is refused: a small body could expand without bound).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from webchat.serve.remote.parse import ChunkError, Lines, sse_data

CONTEXT_WORDS = re.compile(r"context_length_exceeded|context (length|size|window)", re.IGNORECASE)
MAX_LINE_BYTES = 1 << 20  # one SSE line: a chunk of a few tokens with 20 alternatives each is a few KiB
MAX_STREAM_BYTES = 256 << 20  # one streamed reply: ~3 KiB a token with 20 alternatives, 32k tokens is 100 MiB
MAX_JSON_BYTES = 16 << 20  # one JSON answer (a model list of 100,000 ids is ~6 MiB)
MAX_ERROR_BYTES = 64 << 10  # of an error's body: its message is what is shown (300 characters of it)


class UpstreamError(Exception):
    """The upstream is down, slow, answered an error or sent something unreadable; `reachable` False: no answer."""

    def __init__(self, message: str, reachable: bool = True, status: int | None = None) -> None:
        super().__init__(message)
        self.reachable, self.status = reachable, status

    @property
    def context_overflow(self) -> bool:
        """A 400 saying the prompt and max_tokens do not fit (webchat's, vLLM's and llama.cpp's wordings)."""
        return self.status == 400 and CONTEXT_WORDS.search(str(self)) is not None


def display_url(url: str) -> str:
    """The URL without user:password@ and with no trailing slash or `/v1` (what messages and the page show)."""
    parts = urlsplit(url.rstrip("/"))
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port:
        netloc += f":{parts.port}"
    path = parts.path.removesuffix("/v1")
    return urlunsplit((parts.scheme, netloc, path, "", ""))


class Upstream:
    """One upstream engine at `url` (its root: `/v1/...` is appended), with an optional API key."""

    def __init__(self, url: str, key: str | None = None, timeout: float = 60.0, connect_timeout: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--engine-url must be an http(s) URL such as http://127.0.0.1:8001, got {url!r}")
        self.url = display_url(url)
        self.timeout = timeout
        auth = httpx.BasicAuth(parts.username, parts.password or "") if parts.username else None
        headers = {"Accept-Encoding": "identity", **({"Authorization": f"Bearer {key}"} if key else {})}
        self._client = httpx.AsyncClient(
            base_url=self.url if not parts.username else urlunsplit((parts.scheme, parts.netloc,
                                                                     parts.path.rstrip("/").removesuffix("/v1"), "",
                                                                     "")),
            headers=headers, auth=auth, timeout=httpx.Timeout(timeout, connect=min(timeout, connect_timeout)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get_json(self, path: str) -> Any:
        return await self._call("GET", path)

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        return await self._call("POST", path, body)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One JSON request, answered in at most MAX_JSON_BYTES within twice `timeout` (a silent upstream is
        httpx's read timeout, after `timeout`; this bounds one that trickles)."""
        try:
            async with asyncio.timeout(2 * self.timeout):
                async with self._client.stream(method, path, json=body) as resp:
                    if resp.status_code != 200:
                        raise UpstreamError(self._status_message(resp.status_code, await self._error_body(resp)),
                                            status=resp.status_code)
                    content = await self._read(resp, MAX_JSON_BYTES, f"its answer to {path}")
        except TimeoutError:
            raise UpstreamError(f"the upstream engine at {self.url} did not finish answering {path} within "
                                f"{2 * self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None
        return _json(content, f"{self.url}{path}")

    async def stream(self, body: dict[str, Any], headers: dict[str, str] | None = None,
                     path: str = "/v1/chat/completions") -> AsyncGenerator[Any, None]:  # fmt: skip
        """POST `path` (chat or text completions) with stream: true; yields each chunk object until `[DONE]`."""
        try:
            async with self._client.stream("POST", path, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raise UpstreamError(self._status_message(resp.status_code, await self._error_body(resp)),
                                        status=resp.status_code)
                async for data in self._events(resp):
                    if data == "[DONE]":
                        return
                    yield chunk_json(data)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None

    async def _events(self, resp: httpx.Response) -> AsyncIterator[str]:
        """The `data:` payloads of an SSE body, each within `timeout` of the one before, in lines of at most
        MAX_LINE_BYTES and a body of at most MAX_STREAM_BYTES."""
        raw = self._raw(resp)
        loop = asyncio.get_running_loop()
        lines, total, deadline = Lines(MAX_LINE_BYTES), 0, loop.time() + self.timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    part = await anext(raw, None)
            except TimeoutError:
                raise UpstreamError(f"the upstream engine at {self.url} sent no complete event for "
                                    f"{self.timeout:g} s") from None
            if part is None:
                break
            total += len(part)
            if total > MAX_STREAM_BYTES:
                raise UpstreamError(f"the upstream engine at {self.url} sent more than {MAX_STREAM_BYTES} bytes in "
                                    "one reply")
            for line in lines.feed(part):
                data = sse_data(line)
                if data:
                    deadline = loop.time() + self.timeout
                    yield data
        for line in lines.end():
            if data := sse_data(line):
                yield data

    def _raw(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UpstreamError(f"the upstream engine at {self.url} compressed its reply ({encoding}) though "
                                "asked not to")
        return resp.aiter_raw()

    async def _read(self, resp: httpx.Response, limit: int, what: str) -> bytes:
        out = bytearray()
        async for part in self._raw(resp):
            out += part
            if len(out) > limit:
                raise UpstreamError(f"the upstream engine at {self.url} sent more than {limit} bytes in {what}")
        return bytes(out)

    async def _error_body(self, resp: httpx.Response) -> bytes:
        """The first MAX_ERROR_BYTES of an error's body, read within `timeout` (the rest is never read)."""
        out = bytearray()
        try:
            async with asyncio.timeout(self.timeout):
                async for part in self._raw(resp):
                    out += part
                    if len(out) >= MAX_ERROR_BYTES:
                        break
        except (TimeoutError, UpstreamError):
            pass  # what came is what is shown
        return bytes(out[:MAX_ERROR_BYTES])

    def _transport_error(self, exc: httpx.HTTPError) -> UpstreamError:
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return UpstreamError(f"cannot reach the upstream engine at {self.url}: {type(exc).__name__}: {exc}",
                                 reachable=False)
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamError(f"the upstream engine at {self.url} sent nothing for {self.timeout:g} s "
                                 f"({type(exc).__name__})")
        if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
            return UpstreamError(f"the upstream engine at {self.url} closed the connection mid-reply "
                                 f"({type(exc).__name__}: {exc})", reachable=False)
        return UpstreamError(f"the upstream engine at {self.url} failed: {type(exc).__name__}: {exc}")

    def _status_message(self, status: int, content: bytes) -> str:
        detail = content[:300].decode("utf-8", errors="replace")
        if len(content) >= MAX_ERROR_BYTES:  # cut short: not JSON, its start is what is shown
            return (f"the upstream engine at {self.url} answered HTTP {status}: {detail} (the first {MAX_ERROR_BYTES} "
                    "bytes of a longer body)")
        try:
            body = json.loads(content)
            err = body.get("error", body) if isinstance(body, dict) else body
            detail = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            if isinstance(err, dict) and isinstance(err.get("code"), str):
                detail += f" ({err['code']})"
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            pass
        return f"the upstream engine at {self.url} answered HTTP {status}: {detail}"


def _json(content: bytes, where: str) -> Any:
    try:
        return json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamError(f"{where} did not answer JSON: {exc}") from None
    except RecursionError:
        raise UpstreamError(f"{where} answered JSON nested deeper than a JSON reader follows") from None


def chunk_json(data: str) -> Any:
    """One `data:` payload as JSON; ChunkError naming what is wrong otherwise."""
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise ChunkError(f"a chunk is not JSON ({exc.msg} at character {exc.pos}): {data[:80]!r}") from None
    except RecursionError:
        raise ChunkError("a chunk is JSON nested deeper than a JSON reader follows") from None
