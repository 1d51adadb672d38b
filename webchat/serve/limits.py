"""Connection limits under uvicorn: at most `max_connections` sockets, a deadline for finishing the first request,
and accept errors logged at most once per interval.

uvicorn accepts every socket and waits for its request for ever; 400 silent sockets then use up the file limit and
lock every new user out. `guarded_protocols` wraps uvicorn's HTTP and websocket protocol classes so that
    - a socket that has not finished its first request within `handshake_timeout` seconds is closed;
    - past `max_connections` open sockets, a new socket evicts the oldest one still waiting for its request, or is
      answered 503 and closed when every socket is busy (a request or a websocket in progress).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import resource
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from starlette.responses import JSONResponse, PlainTextResponse, Response

log = logging.getLogger("webchat.serve.app")

ACCEPT_LOG_INTERVAL_S = 10.0
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
         b"Content-Length: 43\r\n\r\nthe server has too many connections; retry")


def file_limit() -> int:
    """This process's soft limit on open files (RLIMIT_NOFILE)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections() -> int:
    """A quarter of the file limit (1024 -> 256), between 16 and 4096: the rest is for accepts in flight, model files,
    and the process's own descriptors."""
    return max(16, min(4096, file_limit() // 4))


class ConnectionGuard:
    """Counts the open sockets (an HTTP one becomes a websocket on upgrade) and enforces the two limits."""

    def __init__(self, max_connections: int, handshake_timeout: float) -> None:
        self.max_connections, self.handshake_timeout = max_connections, handshake_timeout
        self.open: OrderedDict[asyncio.BaseTransport, Any] = OrderedDict()  # transport -> HTTP protocol, oldest first
        self.evicted = 0  # sockets closed for the limit or the deadline
        self.refused = 0  # sockets answered 503

    def opened(self, protocol: Any, transport: asyncio.Transport) -> bool:
        """A new socket; False when it was refused (answered 503 and closed)."""
        if len(self.open) >= self.max_connections:
            victim = next((t for t, p in self.open.items() if not _started(p, t)), None)
            if victim is None:
                self.refused += 1
                transport.write(_BUSY)
                transport.close()
                return False
            self._drop(victim)
        self.open[transport] = protocol
        loop = asyncio.get_running_loop()
        loop.call_later(self.handshake_timeout, self._deadline, protocol, transport)
        return True

    def abort_peer(self, client: Any) -> None:
        """Close at once the socket of peer `client` (host, port), e.g. a websocket that does not read."""
        for transport in list(self.open):
            if client is not None and tuple(transport.get_extra_info("peername") or ())[:2] == tuple(client):
                self._drop(transport)

    def closed(self, transport: asyncio.BaseTransport) -> None:
        self.open.pop(transport, None)

    def _deadline(self, protocol: Any, transport: asyncio.Transport) -> None:
        if transport in self.open and not _started(protocol, transport):
            log.info("closed a socket that sent no complete request in %g s", self.handshake_timeout)
            self._drop(transport)

    def _drop(self, transport: asyncio.BaseTransport) -> None:
        self.open.pop(transport, None)
        self.evicted += 1
        if isinstance(transport, asyncio.Transport):
            transport.abort()  # no lingering: the descriptor is free at once


def _started(protocol: Any, transport: asyncio.BaseTransport) -> bool:
    """The socket finished a request's headers (uvicorn's `cycle`), or became a websocket."""
    return getattr(protocol, "cycle", None) is not None or transport.get_protocol() is not protocol


def guarded_protocols(guard: ConnectionGuard, http_class: type[Any],
                      ws_class: type[Any]) -> tuple[type[Any], type[Any]]:  # fmt: skip
    """Subclasses of uvicorn's protocol classes that report to `guard`; pass them as uvicorn's `http` and `ws`."""

    class GuardedHTTP(http_class):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            guard.opened(self, transport)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self.transport)
            super().connection_lost(exc)

    class GuardedWS(ws_class):  # type: ignore[misc]
        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self.transport)
            super().connection_lost(exc)

    return GuardedHTTP, GuardedWS


class AcceptErrorLog:
    """An event-loop exception handler that logs accept() failures ("Too many open files") once per interval, with
    the count of those left out, and everything else as asyncio would."""

    def __init__(self, interval: float = ACCEPT_LOG_INTERVAL_S) -> None:
        self.interval, self.last, self.skipped = interval, float("-inf"), 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "accept" not in message:
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last < self.interval:
            self.skipped += 1
            return
        more = f" ({self.skipped} more in the last {self.interval:g} s)" if self.skipped else ""
        log.error("%s: %s%s", message, context.get("exception"), more)
        self.last, self.skipped = now, 0


API_PATHS = ("/v1/", "/tokenize")
ERROR_TYPES = {401: "authentication_error", 403: "permission_error"}


def refusal(scope: dict[str, Any], status: int, message: str, code: str) -> Response:
    """A middleware's refusal: in the OpenAI API's error shape on its paths (/v1, /tokenize), plain text elsewhere."""
    path = scope.get("path", "")
    if path == "/v1" or path.startswith(API_PATHS):
        return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                                       "param": None, "code": code}}, status_code=status)
    return PlainTextResponse(message, status_code=status)


class HostCheck:
    """ASGI middleware: requests whose Host header names another host get 403 (DNS rebinding on a loopback server)."""

    def __init__(self, app: Any, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, {h.lower() for h in allowed}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            name = urlsplit(f"//{host}").hostname or ""
            if name.lower() not in self.allowed:
                log.warning("refused a request for host %r", host)
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                response = refusal(scope, 403, f"host {host!r} is not served here; use http://127.0.0.1 or localhost",
                                   "host_not_allowed")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class TokenCheck:
    """ASGI middleware: every route needs the access token, as `Authorization: Bearer TOKEN`, the `webchat_token`
    cookie, or `?token=TOKEN` (a page opened that way gets the cookie, so its websocket carries it). /v1 is left to
    the OpenAI API's own --api-key when one is set."""

    COOKIE = "webchat_token"

    def __init__(self, app: Any, token: str, skip_prefix: str | None = None) -> None:
        self.app, self.token, self.skip_prefix = app, token.encode(), skip_prefix

    def _presented(self, scope: dict[str, Any]) -> tuple[bool, bool]:
        """(accepted, from the query string)."""
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer " and hmac.compare_digest(auth[7:].strip(), self.token):
            return True, False
        for part in headers.get(b"cookie", b"").split(b";"):
            name, _, value = part.strip().partition(b"=")
            if name == self.COOKIE.encode() and hmac.compare_digest(value, self.token):
                return True, False
        for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
            if name == "token" and hmac.compare_digest(value.encode(), self.token):
                return True, True
        return False, False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or (
                self.skip_prefix is not None and scope["path"].startswith(self.skip_prefix)):
            await self.app(scope, receive, send)
            return
        ok, from_query = self._presented(scope)
        if not ok:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            response = refusal(scope, 401, "this server needs its access token: open it as /?token=TOKEN, or send "
                               "'Authorization: Bearer TOKEN'", "invalid_access_token")
            await response(scope, receive, send)
            return
        if not from_query or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cookie = f"{self.COOKIE}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict".encode()

        async def send_with_cookie(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
            await send(message)

        await self.app(scope, receive, send_with_cookie)
