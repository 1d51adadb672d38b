"""A real MCP server for the tests, on the SDK's MCPServer: over stdio (`toolserver.py stdio`) or streamable HTTP on an
inherited listening socket (`toolserver.py http FD`); each tool is one behaviour a client must survive."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ContentBlock, EmbeddedResource, ImageContent, TextContent, TextResourceContents

server = MCPServer("webchat-test-tools")
HTML = '<b>bold</b><script>alert("x")</script> & <img src=x onerror=alert(1)> \u00e9\u4e2d'


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def echo_env(name: str) -> str:
    """The value of an environment variable in the server's process, or `<unset>`."""
    return os.environ.get(name, "<unset>")


@server.tool()
async def sleep(seconds: float, marker: str = "") -> str:
    """Sleep; with a marker path, write `started` there first and `cancelled` if the sleep is cancelled."""
    if marker:
        Path(marker).write_text("started")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        if marker:
            Path(marker).write_text("cancelled")
        raise
    return "slept"


@server.tool()
def header(name: str, ctx: Context) -> str:
    """The value of an HTTP request header of this call, or `<unset>` (always on stdio)."""
    return (ctx.headers or {}).get(name.lower(), "<unset>")


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def spawn_child() -> int:
    """Start a child process that sleeps for minutes (left running, in the server's process group); its pid."""
    return subprocess.Popen(["sleep", "300"]).pid


@server.tool()
def crash(marker: str = "") -> str:
    """End the server's process at once, mid-call; with a marker path, write the pid there first."""
    if marker:
        Path(marker).write_text(str(os.getpid()))
    os._exit(3)


@server.tool(structured_output=False)
def big(chars: int) -> str:
    """A text of `chars` characters: digits 0-9 repeated."""
    return ("0123456789" * (chars // 10 + 1))[:chars]


@server.tool()
def html() -> str:
    """A text that is HTML with a script in it."""
    return HTML


@server.tool()
def fail() -> str:
    """A tool that fails: the server reports it as a result with isError."""
    raise ToolError("this tool always fails")


@server.tool()
def mixed() -> list[ContentBlock]:
    """A text, an image and an embedded resource."""
    png = base64.b64encode(b"\x89PNG" + bytes(96)).decode()
    resource = TextResourceContents(uri="file:///notes.txt", mime_type="text/plain", text="n" * 50)
    return [TextContent(text="a picture:"), ImageContent(data=png, mime_type="image/png"),
            EmbeddedResource(resource=resource)]


def main() -> None:
    if sys.argv[1:] == ["stdio"]:
        server.run("stdio")
        return
    if len(sys.argv) == 3 and sys.argv[1] == "http":
        sock = socket.socket(fileno=int(sys.argv[2]))
        app = server.streamable_http_app()
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
        return
    raise SystemExit(f"usage: toolserver.py stdio | http FD, got {sys.argv[1:]}")


if __name__ == "__main__":
    main()
