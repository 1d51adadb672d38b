"""No request can start a process or change a server (issue 66): only the --mcp-config file given at start defines
MCP servers. Every field of every websocket message and of /v1's bodies is sent holding a command, an mcpServers
object or a URL; afterwards the server's process tree, its servers and their tools are what they were, and the
command never ran."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Live
from tools_live import client, descendants, served, write_config

from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=8, max_queue=8, max_seq_len=1024)


@pytest.fixture(scope="module")
def runtime(config: ServerConfig) -> Runtime:
    return load_runtime(config)


@pytest.fixture(scope="module")
def live(config: ServerConfig, runtime: Runtime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with served(config, runtime, write_config(tmp_path_factory.mktemp("mcp") / "mcp.json")) as live:
        yield live


def payloads(marker: Path) -> list[Any]:
    """Values that would start something if anything ran them: a command, a config object, a URL, a path."""
    command = f"touch {marker}"
    entry = {"command": "sh", "args": ["-c", command]}
    return [command, ["sh", "-c", command], {"mcpServers": {"evil": entry}}, entry,
            {"url": "http://127.0.0.1:9/mcp", "headers": {"x": "y"}}, "http://127.0.0.1:9/mcp", sys.executable,
            {"type": "function", "function": {"name": "evil", "command": command}},
            {"type": "mcp", "server_label": "evil", "server_url": "http://127.0.0.1:9/mcp", "command": command}]


def frames(marker: Path) -> list[dict[str, Any]]:
    """Each websocket message with each of its fields (and new ones) holding each payload in turn."""
    user = [{"role": "user", "content": "hi"}]
    base: dict[str, dict[str, Any]] = {
        "generate": {"type": "generate", "id": "g", "messages": user, "max_new_tokens": 1, "tools": ["t__pid"],
                     "tool_choice": "none"},
        "score": {"type": "score", "id": "s", "text": "hi"},
        "stop": {"type": "stop", "id": "x"},
        "call_tool": {"type": "call_tool", "id": "c", "name": "t__pid", "arguments": "{}"},
    }
    fields = {"generate": ["messages", "settings", "stop", "speculative", "model", "response_format",
                           "chat_template_kwargs", "tools", "tool_choice", "mcpServers", "mcp", "command", "url",
                           "servers"],
              "score": ["messages", "text", "model", "mcpServers", "command"],
              "stop": ["id", "mcpServers", "command"],
              "call_tool": ["name", "arguments", "server", "mcpServers", "command", "url", "args", "env"]}
    out = []
    for kind, names in fields.items():
        for name in names:
            for value in payloads(marker):
                out.append({**base[kind], name: value})
                if name == "tools":
                    out.append({**base[kind], name: [value]})
    for kind in ("mcp", "add_server", "config", "mcpServers", "tools", "tool_result"):
        out += [{"type": kind, "id": "z", "mcpServers": {"evil": payloads(marker)[3]}, "command": f"touch {marker}"}]
    return out


def bodies(marker: Path, model: str) -> list[tuple[str, dict[str, Any]]]:
    """/v1 requests with each field holding each payload."""
    user = [{"role": "user", "content": "hi"}]
    out: list[tuple[str, dict[str, Any]]] = []
    for value in payloads(marker):
        for name in ("tools", "tool_choice", "mcpServers", "mcp_servers", "command", "extra_body", "response_format",
                     "chat_template_kwargs", "user"):
            out.append(("/v1/chat/completions", {"model": model, "messages": user, "max_tokens": 1, name: value}))
        out.append(("/v1/chat/completions", {"model": model, "messages": user, "max_tokens": 1, "tools": [value]}))
        out.append(("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1, "mcpServers": value}))
    return out


def test_nothing_sent_starts_a_process_or_changes_a_server(live: Live, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with client(live) as c:
        before = c.ready()
    children = descendants()
    assert children, "the configured stdio server runs"
    sent = frames(marker)
    with client(live) as c:
        for frame in sent:
            c.ws.send(json.dumps(frame))
            c.send(type="stop", id="nothing")  # a valid frame: 256 refused in a row would close the socket
            if frame["type"] == "call_tool":  # a listed, enabled tool with an object may run; the rest is refused
                c.next("tool_result", "error", rid="c")
            elif frame["type"] in ("generate", "score"):
                c.next("done", "scored", "error", rid=frame["id"])
        c.send(type="generate", id="last", messages=[{"role": "user", "content": "hi"}], max_new_tokens=1)
        assert c.next("done", "error", rid="last")["type"] == "done"  # the connection still serves
    codes = []
    model = httpx.get(live.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for path, body in bodies(marker, model):
        response = httpx.post(live.url + path, json=body, timeout=60)
        codes.append(response.status_code)
    assert codes.count(200) < len(codes) and set(codes) <= {200, 400, 422}, sorted(set(codes))
    for path in ("/api/info?mcpServers=x", "/v1/models?command=x", "/healthz?url=x"):
        assert httpx.get(live.url + path, timeout=30).status_code == 200
    with client(live) as c:
        after = c.ready()
    assert descendants() == children, "a request started or stopped a process"
    assert not marker.exists(), "a command in a request ran"
    assert [(s["name"], s["transport"], [t["name"] for t in s["tools"]]) for s in after["servers"]] == [
        (s["name"], s["transport"], [t["name"] for t in s["tools"]]) for s in before["servers"]]
    assert len(sent) > 200
