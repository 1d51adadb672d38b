"""McpManager: every server of the `--mcp-config` file, each connected in its own task; the tools, a status for the
page, and `call`.

Built from an McpConfig only: nothing the page or a request sends can add or change a server. Used as
`async with McpManager(config) as mcp:` (the app's lifespan), or `start()` then `stop()` from the same task: the
manager holds an anyio task group, which is entered and left in one task. `start` returns at once (servers connect
in the background; `wait_started` waits for each one's first attempt); `stop` cancels every server's task, which
stops each stdio server's process group (bounded: 6 s at most, all servers at once).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup

from webchat.mcp.config import McpConfig
from webchat.mcp.connection import ServerConnection, ServerStatus
from webchat.mcp.listing import McpTool
from webchat.mcp.names import split_qualified
from webchat.mcp.result import DEFAULT_MAX_RESULT_CHARS, ToolCallError, ToolResult, to_tool_result


class McpManager:
    """The configured servers' connections, their tools and calls."""

    def __init__(self, config: McpConfig) -> None:
        self.config = config
        self._connections: dict[str, ServerConnection] = {}
        self._group: TaskGroup | None = None
        self._changed: anyio.Event | None = None

    async def __aenter__(self) -> McpManager:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start every enabled server's connection task; returns at once."""
        if self._group is not None:
            raise RuntimeError("McpManager.start: already started")
        self._changed = anyio.Event()
        self._connections = {server.name: ServerConnection(server, self._notify) for server in self.config.servers}
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        for connection in self._connections.values():
            group.start_soon(connection.run, name=f"mcp server {connection.config.name}")

    async def wait_started(self) -> None:
        """Return once every server has connected or failed once (each within its connectTimeout)."""
        for connection in self._connections.values():
            await connection.tried.wait()

    async def stop(self) -> None:
        """Stop every server: calls in flight end with `server_died`, stdio processes are ended, none left behind."""
        group, self._group = self._group, None
        if group is None:
            return
        group.cancel_scope.cancel()
        await group.__aexit__(None, None, None)

    async def wait_changed(self) -> None:
        """Return at the next change of any server's state (the page's status and tool list are then stale)."""
        if self._changed is None:
            raise RuntimeError("McpManager.wait_changed: not started")
        await self._changed.wait()

    def _notify(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = anyio.Event()

    def status(self) -> list[ServerStatus]:
        """Each server's state (connecting, ready, failed, disabled, stopped), message and tool count, in file order."""
        return [connection.status() for connection in self._connections.values()]

    def tools(self) -> list[McpTool]:
        """The ready servers' tools, in file order then each server's order (a snapshot: it changes on reconnect)."""
        return [tool for connection in self._connections.values() for tool in connection.tools()]

    async def call(self, qualified_name: str, arguments: Mapping[str, Any], timeout_s: float | None = None,
                   max_result_chars: int = DEFAULT_MAX_RESULT_CHARS) -> ToolResult:
        """Call a tool by its qualified name; `timeout_s` None: the server's `timeout` from the file (60 s default).

        Raises ToolCallError (its `kind` says why) when no result came; a result the tool marked as an error is a
        ToolResult with `is_error`. Cancelling the awaiting task abandons the call and tells the server.
        """
        server, _ = split_qualified(qualified_name)
        connection = self._connections.get(server)
        listing = connection.listing.tools if connection else ()  # the last one, while it reconnects too
        tool = next((t for t in listing if t.qualified_name == qualified_name), None)
        if connection is None or tool is None:
            known = ", ".join(t.qualified_name for t in self.tools()[:20]) or "none"
            raise ToolCallError("unknown_tool", f"no tool named {qualified_name[:80]!r} (tools: {known})")
        problem = arguments_problem(arguments)
        if problem:
            raise ToolCallError("bad_arguments", f"the arguments of {qualified_name!r} {problem}")
        timeout = connection.config.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        result = await connection.call(tool.name, dict(arguments), timeout)
        return to_tool_result(result, max_result_chars)


def arguments_problem(arguments: Any) -> str | None:
    """Why `arguments` cannot be sent as a tool's arguments (None when they can): a JSON object of finite values."""
    if not isinstance(arguments, Mapping) or not all(isinstance(key, str) for key in arguments):
        return f"must be a JSON object, got {type(arguments).__name__}"
    try:
        json.dumps(arguments, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        return f"are not JSON: {exc}"
    return None
