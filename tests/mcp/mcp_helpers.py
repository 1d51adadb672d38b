"""Real MCP servers for the tests: tests/mcp/toolserver.py over stdio (a child of the manager) or streamable HTTP (a
uvicorn child of the test on a free loopback port), and helpers that wait on a condition (never on a clock)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from webchat.mcp.config import McpConfig, parse_config
from webchat.mcp.manager import McpManager

TOOLSERVER = Path(__file__).resolve().parent / "toolserver.py"
BOUND_S = 30.0  # a guard against a hang, never an expectation


def stdio_entry(**extra: Any) -> dict[str, Any]:
    """A config entry running the test tool server over stdio."""
    return {"command": sys.executable, "args": [str(TOOLSERVER), "stdio"], **extra}


def config(servers: dict[str, dict[str, Any]]) -> McpConfig:
    return parse_config({"mcpServers": servers}, Path.cwd())


async def started(manager: McpManager) -> McpManager:
    """The manager once every server has tried once."""
    with anyio.fail_after(BOUND_S):
        await manager.wait_started()
    return manager


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (polling) until `condition()` holds; fail naming `what` if it never does."""
    with anyio.fail_after(BOUND_S):
        while not condition():
            await anyio.sleep(0.02)


def gone(pid: int) -> bool:
    """Whether a process has ended (a zombie waiting for its parent to reap it counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


class HttpToolServer:
    """The tool server over streamable HTTP on one loopback port, which it keeps across a crash and a restart."""

    def __init__(self) -> None:
        self._socket: socket.socket | None = self._listen(0)
        self.port = self._socket.getsockname()[1]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @staticmethod
    def _listen(port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        return sock

    def start(self) -> None:
        """Listen here, then hand the socket to the child: clients queue until it serves, with no race for the port
        (a restart binds the same port again)."""
        sock, self._socket = self._socket or self._listen(self.port), None
        with sock:
            self.process = subprocess.Popen([sys.executable, str(TOOLSERVER), "http", str(sock.fileno())],
                                            pass_fds=[sock.fileno()], stderr=subprocess.DEVNULL)

    def wait_exit(self) -> int:
        assert self.process is not None
        return self.process.wait(timeout=BOUND_S)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=BOUND_S)


def read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
