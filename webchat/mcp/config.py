"""The `--mcp-config` file: the `mcpServers` form of Claude Desktop, Cursor and LM Studio, read and checked once.

Each entry is a local server (`command`, `args`, `env`, `cwd`: a child process spoken to over stdio) or a remote one
(`url`, `headers`: streamable HTTP). webchat adds `timeout` (a call's limit, seconds), `connectTimeout` (the start
and handshake's, seconds) and `disabled`. Anything else is refused, naming the server and the field: a key another
client reads (`autoApprove`) must not look as if webchat honoured it. Only this file defines servers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from webchat.mcp.names import server_name_problem

DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 60.0  # `npx -y pkg` / `uvx pkg` may download the server on its first start
MAX_TIMEOUT_S = 3600.0
MAX_SERVERS = 32
COMMON = {"type", "timeout", "connectTimeout", "disabled"}
STDIO_KEYS = COMMON | {"command", "args", "env", "cwd"}
HTTP_KEYS = COMMON | {"url", "headers"}
HTTP_TYPES = {"http", "streamable-http", "streamableHttp"}
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
ENV_NAME = re.compile(r"[^=\x00]+")


class McpConfigError(ValueError):
    """The file is missing, is not JSON, or an entry has an unknown key or a value of the wrong kind."""


@dataclass(frozen=True)
class StdioServer:
    """A local server: `command` run with `args` (no shell), in `cwd`, with `env` over the safe inherited variables."""

    name: str
    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold keys: never in a repr or a log
    cwd: Path | None = None
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    disabled: bool = False

    @property
    def transport(self) -> str:
        return "stdio"


@dataclass(frozen=True)
class HttpServer:
    """A remote server at `url` (streamable HTTP), every request sent with `headers`."""

    name: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold a token
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    disabled: bool = False

    @property
    def transport(self) -> str:
        return "http"


ServerConfig = StdioServer | HttpServer


@dataclass(frozen=True)
class McpConfig:
    """Every configured server, in the file's order."""

    servers: tuple[ServerConfig, ...] = ()


def load_config(path: Path) -> McpConfig:
    """The servers `path` defines; a relative `cwd` is taken from the file's folder."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise McpConfigError(f"--mcp-config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise McpConfigError(f"--mcp-config {path}: cannot be read as UTF-8 text ({exc})") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise McpConfigError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except McpConfigError as exc:
        raise McpConfigError(f"{path}: {exc}") from None
    return parse_config(data, path.parent.resolve(), str(path))


def parse_config(data: Any, base: Path, source: str = "mcp config") -> McpConfig:
    """The servers a parsed `mcpServers` document defines (`base`: the folder a relative `cwd` starts from)."""
    if not isinstance(data, dict):
        raise McpConfigError(f"{source}: expected a JSON object with 'mcpServers', got {_kind(data)}")
    extra = sorted(set(data) - {"mcpServers"})
    if extra:
        raise McpConfigError(f"{source}: unknown top-level key {extra[0]!r} (expected only 'mcpServers')")
    entries = data.get("mcpServers")
    if not isinstance(entries, dict):
        raise McpConfigError(f"{source}: 'mcpServers' must be an object of named servers, got {_kind(entries)}")
    if len(entries) > MAX_SERVERS:
        raise McpConfigError(f"{source}: at most {MAX_SERVERS} servers, got {len(entries)}")
    servers = []
    for name, entry in entries.items():
        problem = server_name_problem(name)
        if problem:
            raise McpConfigError(f"{source}: server name: {problem}")
        servers.append(_server(name, entry, base, f"{source}: mcpServers.{name}"))
    return McpConfig(tuple(servers))


def _server(name: str, entry: Any, base: Path, where: str) -> ServerConfig:
    if not isinstance(entry, dict):
        raise McpConfigError(f"{where}: expected an object, got {_kind(entry)}")
    kind = _transport(entry, where)
    unknown = sorted(set(entry) - (STDIO_KEYS if kind == "stdio" else HTTP_KEYS))
    if unknown:
        allowed = ", ".join(sorted(STDIO_KEYS if kind == "stdio" else HTTP_KEYS))
        raise McpConfigError(f"{where}: unknown key {unknown[0]!r} for a {kind} server (expected {allowed})")
    timeout = _seconds(entry, "timeout", DEFAULT_CALL_TIMEOUT_S, where)
    connect = _seconds(entry, "connectTimeout", DEFAULT_CONNECT_TIMEOUT_S, where)
    disabled = entry.get("disabled", False)
    if not isinstance(disabled, bool):
        raise McpConfigError(f"{where}.disabled: expected true or false, got {_kind(disabled)}")
    if kind == "http":
        return HttpServer(name, _url(entry.get("url"), where), _headers(entry.get("headers", {}), where),
                          timeout, connect, disabled)
    command = entry.get("command")
    if not isinstance(command, str) or not command.strip() or "\x00" in command:
        raise McpConfigError(f"{where}.command: expected a non-empty string, got {_kind(command)}")
    args = entry.get("args", [])
    if not isinstance(args, list):
        raise McpConfigError(f"{where}.args: expected a list of strings, got {_kind(args)}")
    for i, arg in enumerate(args):
        if not isinstance(arg, str) or "\x00" in arg:
            raise McpConfigError(f"{where}.args[{i}]: expected a string without NUL, got {_kind(arg)}")
    env = _string_map(entry.get("env", {}), f"{where}.env", ENV_NAME)
    return StdioServer(name, command, tuple(args), env, _cwd(entry.get("cwd"), base, where), timeout, connect,
                       disabled)


def _transport(entry: dict[str, Any], where: str) -> str:
    declared = entry.get("type")
    if declared == "sse":
        raise McpConfigError(f"{where}.type: the old SSE transport is not supported; give the server's streamable "
                             f"HTTP endpoint (often its URL ending in /mcp)")
    if declared is not None and declared != "stdio" and declared not in HTTP_TYPES:
        raise McpConfigError(f"{where}.type: expected 'stdio' or 'http', got {declared!r}")
    if "command" in entry and "url" in entry:
        raise McpConfigError(f"{where}: has both 'command' (a local server) and 'url' (a remote one); keep one")
    kind = "stdio" if "command" in entry else "http" if "url" in entry else None
    if kind is None:
        raise McpConfigError(f"{where}: expected 'command' (a local server) or 'url' (a remote one), got neither")
    if declared is not None and (declared == "stdio") != (kind == "stdio"):
        given = "url" if kind == "http" else "command"
        raise McpConfigError(f"{where}.type: {declared!r} does not match a server given by {given!r}")
    return kind


def _seconds(entry: dict[str, Any], key: str, default: float, where: str) -> float:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TIMEOUT_S:
        raise McpConfigError(f"{where}.{key}: expected seconds, a number in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    return float(value)


def _url(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise McpConfigError(f"{where}.url: expected a string, got {_kind(value)}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise McpConfigError(f"{where}.url: expected an http(s) URL such as https://host/mcp, got {value!r}")
    if parts.username is not None or parts.password is not None:
        raise McpConfigError(f"{where}.url: credentials in the URL are refused; send them in 'headers'")
    return value


def _headers(value: Any, where: str) -> dict[str, str]:
    headers = _string_map(value, f"{where}.headers", HEADER_NAME)
    for name, text in headers.items():
        if any(c in text for c in "\r\n\x00"):
            raise McpConfigError(f"{where}.headers.{name}: a header value cannot hold a line break or NUL")
    return headers


def _string_map(value: Any, where: str, names: re.Pattern[str]) -> dict[str, str]:
    if not isinstance(value, dict):
        raise McpConfigError(f"{where}: expected an object of strings, got {_kind(value)}")
    for key, text in value.items():
        if not names.fullmatch(key):
            raise McpConfigError(f"{where}: {key!r} is not a valid name")
        if not isinstance(text, str) or "\x00" in text:
            raise McpConfigError(f"{where}.{key}: expected a string, got {_kind(text)}")
    return dict(value)


def _cwd(value: Any, base: Path, where: str) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise McpConfigError(f"{where}.cwd: expected a folder's path, got {_kind(value)}")
    path = (base / Path(value).expanduser()).resolve()
    if not path.is_dir():
        raise McpConfigError(f"{where}.cwd: no such folder: {path}")
    return path


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise McpConfigError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _kind(value: Any) -> str:
    """A value as an error shows it: its JSON kind, and the value itself when it is short."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, dict | list) else ""
    return kinds.get(type(value), type(value).__name__) + (f" {text}" if text and len(text) <= 60 else "")
