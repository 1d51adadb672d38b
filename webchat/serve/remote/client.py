"""The upstream's HTTP client (httpx, async): JSON calls and the chat stream as decoded `data:` objects.

Leaving `stream` early (a Stop, a disconnect, an error) closes its response, and with it the TCP connection:
that close is what vLLM, SGLang, llama.cpp's server and webchat take as the client gone, and abort on.
Every failure is an UpstreamError whose message names the upstream (its URL, never its key).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from webchat.serve.remote.parse import ChunkError, sse_data

CONTEXT_WORDS = re.compile(r"context_length_exceeded|context (length|size|window)", re.IGNORECASE)


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
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.AsyncClient(
            base_url=self.url if not parts.username else urlunsplit((parts.scheme, parts.netloc,
                                                                     parts.path.rstrip("/").removesuffix("/v1"), "",
                                                                     "")),
            headers=headers, auth=auth, timeout=httpx.Timeout(timeout, connect=min(timeout, connect_timeout)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get_json(self, path: str) -> Any:
        try:
            resp = await self._client.get(path)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None
        if resp.status_code != 200:
            raise UpstreamError(self._status_message(resp.status_code, resp.content), status=resp.status_code)
        return _json(resp.content, f"{self.url}{path}")

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        try:
            resp = await self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None
        if resp.status_code != 200:
            raise UpstreamError(self._status_message(resp.status_code, resp.content), status=resp.status_code)
        return _json(resp.content, f"{self.url}{path}")

    async def stream(self, body: dict[str, Any], headers: dict[str, str] | None = None,
                     path: str = "/v1/chat/completions") -> AsyncGenerator[Any, None]:  # fmt: skip
        """POST `path` (chat or text completions) with stream: true; yields each chunk object until `[DONE]`."""
        try:
            async with self._client.stream("POST", path, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raise UpstreamError(self._status_message(resp.status_code, await resp.aread()),
                                        status=resp.status_code)
                async for line in resp.aiter_lines():
                    data = sse_data(line)
                    if data is None or not data:
                        continue
                    if data == "[DONE]":
                        return
                    try:
                        yield json.loads(data)
                    except json.JSONDecodeError as exc:
                        raise ChunkError(f"a chunk is not JSON ({exc.msg} at character {exc.pos}): "
                                         f"{data[:80]!r}") from None
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None

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
        try:
            body = json.loads(content)
            err = body.get("error", body) if isinstance(body, dict) else body
            detail = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            if isinstance(err, dict) and isinstance(err.get("code"), str):
                detail += f" ({err['code']})"
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
        return f"the upstream engine at {self.url} answered HTTP {status}: {detail}"


def _json(content: bytes, where: str) -> Any:
    try:
        return json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamError(f"{where} did not answer JSON: {exc}") from None
