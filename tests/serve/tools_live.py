"""Shared by the websocket's tools tests: a served tiny model with an --mcp-config of tests/mcp/toolserver.py over
stdio, and a client that reads the frames it waits for (never a clock, except a guard against a hang)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from live_server import Live, serve
from websockets.sync.client import ClientConnection, connect

from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime

TOOLSERVER = Path(__file__).resolve().parents[1] / "mcp" / "toolserver.py"
BOUND_S = 60.0  # a guard against a hang, never an expectation


def write_config(path: Path, **timeouts: float) -> Path:
    """An --mcp-config of stdio servers running the test tool server, each with its call time limit (seconds); by
    default one, `t`, with 60 s."""
    servers = {name: {"command": sys.executable, "args": [str(TOOLSERVER), "stdio"], "timeout": timeout}
               for name, timeout in (timeouts or {"t": 60.0}).items()}
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


@contextmanager
def served(config: ServerConfig, runtime: Runtime, mcp_config: Path | None, **extra: Any) -> Iterator[Live]:
    from dataclasses import replace

    with serve(replace(config, mcp_config=mcp_config, **extra), runtime) as live:
        yield live


class Client:
    """One websocket: frames read in order; `tools` messages kept aside as they come."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.tools: list[dict[str, Any]] = []
        self.hello = self.next("hello")

    def send(self, **frame: Any) -> None:
        self.ws.send(json.dumps(frame))

    def next(self, *types: str, rid: str | None = None) -> dict[str, Any]:
        """The next frame of one of `types` (and request `rid` when given); `tools` frames are collected on the way."""
        while True:
            msg = json.loads(self.ws.recv(timeout=BOUND_S))
            if msg["type"] == "tools":
                self.tools.append(msg)
            if msg["type"] in types and (rid is None or msg.get("id") == rid):
                return msg  # type: ignore[no-any-return]

    def ready(self, server: str = "t") -> dict[str, Any]:
        """The latest tools message once `server` is ready."""
        while True:
            last = self.tools[-1] if self.tools else self.next("tools")
            entry = next(s for s in last["servers"] if s["name"] == server)
            if entry["state"] == "ready":
                return last
            self.next("tools")

    def enable(self, rid: str, *tools: str) -> dict[str, Any]:
        """A generate that switches `tools` on and calls none (tool_choice none, one token): its done."""
        self.send(type="generate", id=rid, messages=[{"role": "user", "content": "hi"}], max_new_tokens=1,
                  tools=list(tools), tool_choice="none")
        return self.next("done", "error", rid=rid)

    def call(self, rid: str, name: str, arguments: Any) -> dict[str, Any]:
        self.send(type="call_tool", id=rid, name=name, arguments=json.dumps(arguments))
        return self.next("tool_result", "error", rid=rid)


@contextmanager
def client(live: Live) -> Iterator[Client]:
    with connect(live.ws_url, max_size=None) as ws:
        yield Client(ws)


def descendants(pid: int | None = None) -> set[int]:
    """Every living process below `pid` (default: this one), read from /proc."""
    root = pid or os.getpid()
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out
