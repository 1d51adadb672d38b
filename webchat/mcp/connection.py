"""One configured server: a long-lived task that connects, lists the tools, watches the connection and reconnects
with backoff; calls run in their caller's task on the session that task holds.

The SDK's rule: a session is entered and left in one task (its transport and session hold anyio task groups), so
`run` owns it from connect to close. A call is a request on that session from any task: cancelling the caller
abandons it at once and the SDK then sends the server `notifications/cancelled` (shielded, at most 5 s); a call past
its time limit is cancelled the same way. The connection is checked (`probe`) when a call saw it break and every
HEALTH_INTERVAL_S while no call runs; a stdio server's closed output ends it at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, Literal

import anyio
import httpx2
from mcp import Client, MCPError
from mcp_types import CONNECTION_CLOSED, CallToolResult, Implementation
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from webchat.mcp.config import HttpServer, ServerConfig
from webchat.mcp.listing import Listing, McpTool, list_tools
from webchat.mcp.result import ToolCallError
from webchat.mcp.stdio import stdio_transport
from webchat.mcp.transport import TOO_LARGE, Link, display_url, http_transport

if TYPE_CHECKING:
    from mcp.client._transport import TransportStreams

log = logging.getLogger("webchat.mcp")


def _version() -> str:
    try:
        return version("webchat")
    except PackageNotFoundError:
        return "0"


CLIENT_INFO = Implementation(name="webchat", version=_version())
HEALTH_INTERVAL_S = 30.0
PROBE_TIMEOUT_S = 10.0
STABLE_S = 10.0  # a connection that lasted this long resets the backoff
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
State = Literal["connecting", "ready", "failed", "disabled", "stopped"]


@dataclass(frozen=True)
class ServerStatus:
    """A server as the page shows it: `message` says why it failed; `retry_in_s` when the next try starts."""

    name: str
    transport: str  # "stdio" | "http"
    state: State
    message: str = ""
    tool_count: int = 0
    notes: tuple[str, ...] = ()  # what its listing left out or cut
    retry_in_s: float | None = None


class ServerConnection:
    """One server's connection, made and remade by `run`; `call` waits for it, up to the call's time limit."""

    def __init__(self, config: ServerConfig, on_change: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self._on_change = on_change
        self.listing = Listing()
        self._state: State = "disabled" if config.disabled else "connecting"
        self._message = ""
        self._retry_at = 0.0
        self._client: Client | None = None
        self._link: Link | None = None
        self._in_flight = 0
        self._ready_at: float | None = None
        self._changed = anyio.Event()  # set (and replaced) on every change of state
        self._wake = anyio.Event()  # set when the connection may be broken
        self.tried = anyio.Event()  # the first attempt has ended, ready or failed

    def status(self) -> ServerStatus:
        retry = max(0.0, self._retry_at - anyio.current_time()) if self._state == "failed" else None
        return ServerStatus(self.config.name, self.config.transport, self._state, self._message,
                            len(self.listing.tools), self.listing.notes, retry)

    def tools(self) -> tuple[McpTool, ...]:
        return self.listing.tools if self._state == "ready" else ()

    def poke(self) -> None:
        """Have the watcher check the connection now."""
        self._wake.set()

    async def run(self) -> None:
        """Connect, serve, and reconnect after a failure (0.5 s, doubling to 30 s), until cancelled."""
        try:
            if not self.config.disabled:
                await self._serve()
        except Exception as exc:  # a bug here must not take the app (the manager's task group) down
            log.exception("MCP server %s: its connection task failed", self.config.name)
            self._set("failed", f"webchat's connection to it failed: {describe(exc, self.config)}")
        except BaseException:  # cancelled: the manager stops
            self._set("stopped")
            raise
        finally:
            self.tried.set()

    async def _serve(self) -> None:
        failures = 0
        while True:
            if self._state != "failed":  # a retry stays `failed`, with why, until it is ready
                self._set("connecting")
            link = Link(self.poke)
            self._ready_at = None
            try:
                reason = await self._connect_once(link)
            except Exception as exc:
                reason = describe(exc, self.config)
            stable = self._ready_at is not None and anyio.current_time() - self._ready_at >= STABLE_S
            failures = 0 if stable else failures + 1
            message = "; ".join(part for part in (reason, link.epilogue()) if part)
            log.warning("MCP server %s: %s", self.config.name, message)
            delay = 0.0 if stable else min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))
            self._retry_at = anyio.current_time() + delay
            self._set("failed", message)
            self.tried.set()
            await anyio.sleep(delay)

    async def _connect_once(self, link: Link) -> str:
        """One connection from start to end; returns why it ended (raises when it could not be made)."""
        limit = self.config.connect_timeout_s
        with anyio.CancelScope(deadline=anyio.current_time() + limit) as scope:
            async with Client(self._transport(link), cache=None, client_info=CLIENT_INFO) as client:
                listing = await list_tools(client, self.config.name)
                scope.deadline = math.inf
                self.listing, self._client, self._link = listing, client, link
                self._ready_at = anyio.current_time()
                self._set("ready")
                self.tried.set()
                try:
                    reason = await self._watch(client, link)
                finally:
                    self._client = None
                self._retry_at = anyio.current_time()
                self._set("failed", reason)  # while the session closes; `run` then adds the process's exit
                return reason
        return f"did not start and answer within {limit:g} s (connectTimeout)"

    def _transport(self, link: Link) -> AbstractAsyncContextManager[TransportStreams]:
        if isinstance(self.config, HttpServer):
            return http_transport(self.config)
        return stdio_transport(self.config, link)

    async def _watch(self, client: Client, link: Link) -> str:
        """Wait until the connection is found broken; returns how."""
        while True:
            with anyio.move_on_after(HEALTH_INTERVAL_S):
                await self._wake.wait()
            woken, self._wake = self._wake.is_set(), anyio.Event()
            if link.closed:
                return link.closed
            if not woken and self._in_flight:
                continue  # a server busy with a call may be slow to answer a check; its call will tell
            try:
                with anyio.fail_after(PROBE_TIMEOUT_S):
                    await probe(client)
            except Exception as exc:
                return f"stopped answering: {describe(exc, self.config)}"

    async def call(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> CallToolResult:
        """`tool` (the server's name for it) called with `arguments`; ToolCallError unless the server answered."""
        who = f"the MCP server {self.config.name!r}"
        deadline = anyio.current_time() + timeout_s
        client, link = await self._connected(deadline, timeout_s)
        self._in_flight += 1
        try:
            with anyio.move_on_after(deadline - anyio.current_time()):
                return await client.call_tool(tool, arguments)
            self.poke()  # a hung server is restarted when it does not answer the check either
            raise ToolCallError("timeout", f"{who} did not answer {tool!r} within {timeout_s:g} s; the call was "
                                           f"cancelled")
        except MCPError as exc:
            self.poke()  # an expired HTTP session, a closed stream: the check finds out and reconnects
            if link.too_large or TOO_LARGE in exc.message or "byte limit" in exc.message:  # stdio, JSON, SSE
                raise ToolCallError("too_large", f"{who}'s answer to {tool!r} was {TOO_LARGE}") from None
            if exc.code != CONNECTION_CLOSED:
                raise ToolCallError("server_error", f"{who} answered {tool!r} with error {exc.code}: "
                                                    f"{exc.message[:500]}") from None
            raise ToolCallError("server_died", f"{who} closed the connection during {tool!r} "
                                               f"({link.closed or exc.message})") from None
        except (ValidationError, RuntimeError) as exc:  # not a CallToolResult; structured content off its schema
            raise ToolCallError("protocol", f"{who} answered {tool!r} with something that is not a valid result: "
                                            f"{describe(exc, self.config)}") from None
        except (httpx2.HTTPError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            self.poke()
            raise ToolCallError("server_died", f"{who} could not be reached during {tool!r}: "
                                               f"{describe(exc, self.config)}") from None
        finally:
            self._in_flight -= 1

    async def _connected(self, deadline: float, timeout_s: float) -> tuple[Client, Link]:
        """The session, once ready: waited for while connecting or when the next try comes before `deadline`."""
        who = f"the MCP server {self.config.name!r}"
        while self._client is None or self._link is None:
            if self._state in ("disabled", "stopped"):
                raise ToolCallError("unavailable", f"{who} is {self._state}")
            if self._state == "failed" and self._retry_at > deadline:
                raise ToolCallError("unavailable", f"{who} is not connected: {self._message}")
            with anyio.move_on_after(deadline - anyio.current_time()):
                await self._changed.wait()
            if anyio.current_time() >= deadline:
                raise ToolCallError("unavailable", f"{who} did not connect within the call's {timeout_s:g} s")
        return self._client, self._link

    def _set(self, state: State, message: str = "") -> None:
        self._state, self._message = state, message
        self._changed.set()
        self._changed = anyio.Event()
        self._on_change()


async def probe(client: Client) -> None:
    """One cheap request: `ping` on a handshake-era session, `server/discover` on a 2026 one (which has no ping)."""
    protocol = client.protocol_version
    if protocol in MODERN_PROTOCOL_VERSIONS:
        await client.session.send_discover(protocol)
    else:
        await client.session.send_ping()


def describe(exc: BaseException, config: ServerConfig) -> str:
    """An exception as one line for a status or an error: the first leaf of a group, its type when it says nothing."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError):
        return f"error {exc.code}: {exc.message[:300]}"
    if isinstance(exc, FileNotFoundError) and not isinstance(config, HttpServer):
        return f"cannot start {config.command!r}: no such program (is it on PATH?)"
    if isinstance(exc, httpx2.HTTPError) and isinstance(config, HttpServer):
        return f"{display_url(config.url)}: {type(exc).__name__}: {str(exc)[:300]}"
    text = str(exc)[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
