"""The page's tests' MCP server (e2e/test_tools.py), on the SDK's MCPServer, over stdio (`page_tools_server.py stdio`)
or streamable HTTP on an inherited listening socket (`page_tools_server.py http FD`). Every tool takes no argument or
one from a short list, so the tiny random model, forced to call it, finishes the call in a few tokens."""

from __future__ import annotations

import os
import socket
import sys
from typing import Literal

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer

server = MCPServer("webchat-page-tools")
HTML = '<b>bold</b><script>document.title = "pwned"</script><img src=x onerror="document.title = \'pwned\'"> & done'
HUGE = 10_000_000


@server.tool()
def now() -> str:
    """The current time (always the same one here)."""
    return "2026-11-30T12:00:00+00:00"


@server.tool()
def weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
    """Today's weather in a city."""
    return f"{city}: sunny, 21 °C"


@server.tool()
async def slow() -> str:
    """Sleeps for an hour (past any call's time limit)."""
    await anyio.sleep(3600)
    return "slept"


@server.tool()
def crash() -> str:
    """Ends the server's process mid-call."""
    os._exit(3)


@server.tool(structured_output=False)
def huge() -> str:
    """Ten million characters of text."""
    return "0123456789" * (HUGE // 10)


@server.tool()
def html() -> str:
    """A text that is HTML with a script in it."""
    return HTML


def main() -> None:
    if sys.argv[1:] == ["stdio"]:
        server.run("stdio")
    elif len(sys.argv) == 3 and sys.argv[1] == "http":
        sock = socket.socket(fileno=int(sys.argv[2]))
        uvicorn.Server(uvicorn.Config(server.streamable_http_app(), log_level="warning")).run(sockets=[sock])
    else:
        raise SystemExit(f"usage: page_tools_server.py stdio | http FD, got {sys.argv[1:]}")


if __name__ == "__main__":
    main()
