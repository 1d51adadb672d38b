"""The `--mcp-config` file: the mcpServers form read, each bad field refused by name, and the names the model sees."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from webchat.mcp.config import HttpServer, McpConfigError, StdioServer, load_config, parse_config
from webchat.mcp.names import qualify, server_name_problem, split_qualified

QUALIFIED = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_the_claude_desktop_and_lm_studio_form_is_read(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    path = write(tmp_path, {"mcpServers": {
        "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}, "cwd": "work", "timeout": 5},
        "hf-mcp-server": {"url": "https://huggingface.co/mcp", "headers": {"Authorization": "Bearer secret"}},
        "off": {"type": "stdio", "command": "x", "disabled": True},
    }})
    time, hf, off = load_config(path).servers
    assert time == StdioServer("time", "uvx", ("mcp-server-time",), {"TZ": "UTC"}, tmp_path / "work", 5.0)
    assert isinstance(hf, HttpServer) and hf.headers == {"Authorization": "Bearer secret"}
    assert (hf.timeout_s, hf.connect_timeout_s, hf.transport) == (60.0, 60.0, "http")
    assert off.disabled and off.transport == "stdio"
    assert "secret" not in repr(hf) and "UTC" not in repr(time)  # headers and env never reach a log


def test_a_missing_file_and_a_file_that_is_not_json_are_named(tmp_path: Path) -> None:
    with pytest.raises(McpConfigError, match=r"--mcp-config .*nowhere\.json: no such file"):
        load_config(tmp_path / "nowhere.json")
    with pytest.raises(McpConfigError, match=r"mcp\.json: not JSON: .* at line 1, column"):
        load_config(write(tmp_path, "{'mcpServers': {}}"))
    with pytest.raises(McpConfigError, match=r"mcp\.json: the key 'a' appears twice"):
        load_config(write(tmp_path, '{"mcpServers": {"a": {"command": "x"}, "a": {"command": "y"}}}'))


BAD: list[tuple[Any, str]] = [
    ([], r"expected a JSON object with 'mcpServers', got a list"),
    ({"servers": {}}, r"unknown top-level key 'servers'"),
    ({"mcpServers": []}, r"'mcpServers' must be an object of named servers, got a list"),
    ({"mcpServers": {"Google Maps": {"command": "x"}}}, r"server name: expected 1-32 letters.*got 'Google Maps'"),
    ({"mcpServers": {"a__b": {"command": "x"}}}, r"server name: .*got 'a__b'"),
    ({"mcpServers": {"s": "npx"}}, r"mcpServers\.s: expected an object, got a string \"npx\""),
    ({"mcpServers": {"s": {}}}, r"mcpServers\.s: expected 'command' \(a local server\) or 'url'"),
    ({"mcpServers": {"s": {"command": "x", "url": "http://h/mcp"}}}, r"mcpServers\.s: has both 'command'"),
    ({"mcpServers": {"s": {"command": "x", "autoApprove": ["t"]}}},
     r"mcpServers\.s: unknown key 'autoApprove' for a stdio server \(expected args, command"),
    ({"mcpServers": {"s": {"url": "http://h/mcp", "env": {}}}}, r"mcpServers\.s: unknown key 'env' for a http server"),
    ({"mcpServers": {"s": {"command": ""}}}, r"mcpServers\.s\.command: expected a non-empty string, got a string"),
    ({"mcpServers": {"s": {"command": 7}}}, r"mcpServers\.s\.command: expected a non-empty string, got a number 7"),
    ({"mcpServers": {"s": {"command": "x", "args": "-y pkg"}}}, r"mcpServers\.s\.args: expected a list of strings"),
    ({"mcpServers": {"s": {"command": "x", "args": ["-y", 3]}}}, r"mcpServers\.s\.args\[1\]: expected a string"),
    ({"mcpServers": {"s": {"command": "x", "env": {"A": 1}}}}, r"mcpServers\.s\.env\.A: expected a string, got a num"),
    ({"mcpServers": {"s": {"command": "x", "env": {"A=B": "1"}}}}, r"mcpServers\.s\.env: 'A=B' is not a valid name"),
    ({"mcpServers": {"s": {"command": "x", "cwd": "no/such/dir"}}}, r"mcpServers\.s\.cwd: no such folder: "),
    ({"mcpServers": {"s": {"command": "x", "timeout": 0}}}, r"mcpServers\.s\.timeout: expected seconds.*got 0"),
    ({"mcpServers": {"s": {"command": "x", "timeout": "60"}}}, r"mcpServers\.s\.timeout: expected seconds.*'60'"),
    ({"mcpServers": {"s": {"command": "x", "connectTimeout": True}}}, r"mcpServers\.s\.connectTimeout: expected"),
    ({"mcpServers": {"s": {"command": "x", "disabled": "yes"}}}, r"mcpServers\.s\.disabled: expected true or false"),
    ({"mcpServers": {"s": {"url": "ftp://h/mcp"}}}, r"mcpServers\.s\.url: expected an http\(s\) URL"),
    ({"mcpServers": {"s": {"url": "https://u:p@h/mcp"}}}, r"mcpServers\.s\.url: credentials in the URL are refused"),
    ({"mcpServers": {"s": {"url": "http://h/mcp", "headers": {"A": 1}}}}, r"mcpServers\.s\.headers\.A: expected a s"),
    ({"mcpServers": {"s": {"url": "http://h/mcp", "headers": {"A B": "1"}}}}, r"mcpServers\.s\.headers: 'A B' is n"),
    ({"mcpServers": {"s": {"url": "http://h/mcp", "headers": {"A": "1\r\nB: 2"}}}}, r"mcpServers\.s\.headers\.A: a h"),
    ({"mcpServers": {"s": {"type": "sse", "url": "http://h/sse"}}}, r"mcpServers\.s\.type: the old SSE transport"),
    ({"mcpServers": {"s": {"type": "websocket", "url": "ws://h"}}}, r"mcpServers\.s\.type: expected 'stdio' or 'http'"),
    ({"mcpServers": {"s": {"type": "http", "command": "x"}}}, r"mcpServers\.s\.type: 'http' does not match a server"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_each_bad_field_is_refused_naming_the_server_and_the_field(tmp_path: Path, data: Any, message: str) -> None:
    with pytest.raises(McpConfigError, match=message):
        parse_config(data, tmp_path, "mcp.json")


def test_server_names_keep_qualified_names_apart() -> None:
    assert server_name_problem("web-search") is None and server_name_problem("my_files") is None
    for bad in ("", "_a", "a_", "a__b", "a.b", "a" * 33, "é"):
        assert server_name_problem(bad) is not None, bad
    assert split_qualified("my_files__read__all") == ("my_files", "read__all")


def test_tool_names_become_safe_unique_qualified_names() -> None:
    taken: set[str] = set()
    names = [qualify("srv", tool, taken) for tool in ("read.file", "read_file", "read file", "x" * 100, "x" * 100, "")]
    assert names[:3] == ["srv__read_file", "srv__read_file_2", "srv__read_file_3"]
    assert names[3] == "srv__" + "x" * 59 and names[4] == "srv__" + "x" * 57 + "_2"
    assert names[5] == "srv___"
    assert all(QUALIFIED.fullmatch(name) for name in names) and len(set(names)) == len(names)
