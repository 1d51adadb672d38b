"""The --mcp-config servers as the websocket offers them (issue 66): the `tools` message (each server's state and
tools, with what each tool costs of the context), a `generate`'s enabled tools as its Turn's Tools, and a
`call_tool` checked and run within the manager's limits.

Only the file given at start defines servers (webchat.mcp.manager): a request names tools by the names listed here,
never a definition, a command or a URL. Imported only when `--mcp-config` is given (the MCP SDK costs ~0.75 s).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from webchat.mcp.listing import McpTool
from webchat.mcp.manager import McpManager
from webchat.mcp.result import DEFAULT_MAX_RESULT_CHARS, ToolCallError
from webchat.serve import protocol as p
from webchat.serve.rules import loads, short_repr
from webchat.serve.tools import Tool

CHARS_PER_TOKEN = 3.5  # a tool's cost where no tokenizer is here to count it (a remote engine): an estimate


class ToolHub:
    """The manager's servers and tools for the websocket; `count` gives a text's tokens for the default model."""

    def __init__(self, manager: McpManager, result_chars: int = DEFAULT_MAX_RESULT_CHARS,
                 count: Callable[[str], int] | None = None) -> None:  # fmt: skip
        self.manager, self.result_chars, self.count = manager, result_chars, count
        self.listed: set[str] = set()  # every qualified name any server has listed since start
        self._tokens: dict[str, int] = {}  # a tool's JSON text → its tokens

    async def wait_changed(self) -> None:
        await self.manager.wait_changed()

    def message(self) -> p.Tools:
        """Every server (file order) with its state and, when ready, its tools."""
        by_server: dict[str, list[McpTool]] = {}
        for tool in self.manager.tools():
            by_server.setdefault(tool.server, []).append(tool)
            self.listed.add(tool.qualified_name)
        servers = [{"name": s.name, "transport": s.transport, "state": s.state, "message": s.message,
                    "notes": list(s.notes), "retry_in_s": None if s.retry_in_s is None else round(s.retry_in_s, 1),
                    "tools": [self._wire(t) for t in by_server.get(s.name, [])]} for s in self.manager.status()]
        return p.Tools(servers=servers, max_result_chars=self.result_chars)

    def _wire(self, tool: McpTool) -> dict[str, Any]:
        return {"name": tool.qualified_name, "tool": tool.name, "title": tool.title, "description": tool.description,
                "parameters": tool.input_schema, "tokens": self.tokens(tool)}

    def tokens(self, tool: McpTool) -> int:
        """What the tool's definition costs of the prompt, about: its JSON counted by the default model's tokenizer."""
        text = json.dumps(tool.as_function(), ensure_ascii=False)
        if text not in self._tokens:
            self._tokens[text] = self.count(text) if self.count else math.ceil(len(text) / CHARS_PER_TOKEN)
        return self._tokens[text]

    def enabled(self, names: Iterable[str], request_id: str) -> tuple[list[Tool], int]:
        """The tools a `generate` switched on, as a Turn's Tools take them, and their cost in tokens; ProtocolError
        `unknown_tool` naming one that no ready server lists now."""
        ready = {t.qualified_name: t for t in self.manager.tools()}
        tools, cost = [], 0
        for i, name in enumerate(names):
            tool = ready.get(name)
            if tool is None:
                known = ", ".join(list(ready)[:20]) or "none (no server is ready)"
                raise p.ProtocolError("unknown_tool", f"field 'tools.{i}': no ready MCP server lists a tool named "
                                      f"{short_repr(name)}; the tools are: {known}", request_id)
            function = tool.as_function()
            function["function"]["parameters"] = closed(tool.input_schema)
            tools.append(Tool.model_validate(function))
            cost += self.tokens(tool)
        return tools, cost

    def check_call(self, msg: p.CallTool, enabled: set[str]) -> dict[str, Any]:
        """A `call_tool`'s arguments once it names a listed tool the last `generate` enabled and they are a JSON
        object; else ProtocolError `unknown_tool`, `tool_not_enabled` or `bad_arguments`."""
        self.message()  # the names listed so far include the current ones
        if msg.name not in self.listed:
            raise p.ProtocolError("unknown_tool", f"field 'name': no MCP server of this server's --mcp-config lists "
                                  f"a tool named {short_repr(msg.name)}", msg.id)
        if msg.name not in enabled:
            on = ", ".join(sorted(enabled)) or "none"
            raise p.ProtocolError("tool_not_enabled", f"field 'name': {msg.name!r} was not switched on for this "
                                  f"conversation (the last generate's tools: {on})", msg.id)
        try:
            arguments = loads(msg.arguments)
        except (ValueError, RecursionError) as exc:
            raise p.ProtocolError("bad_arguments", f"field 'arguments': expected a JSON object, got text that is not "
                                  f"JSON ({exc})", msg.id) from None
        if not isinstance(arguments, dict):
            raise p.ProtocolError("bad_arguments", f"field 'arguments': expected a JSON object, got "
                                  f"{type(arguments).__name__} {short_repr(arguments)}", msg.id)
        return arguments

    async def call(self, request_id: str, name: str, arguments: dict[str, Any]) -> p.ToolResult:
        """The call's answer: its result as text (cut at result_chars, with a note), or its error by kind (a server
        that hangs or dies is this call's error, never the connection's)."""
        start = time.monotonic()
        try:
            result = await self.manager.call(name, arguments, max_result_chars=self.result_chars)
        except ToolCallError as exc:
            return p.ToolResult(id=request_id, name=name, text=str(exc), is_error=True, error=exc.kind,
                                ms=_ms(start))
        return p.ToolResult(id=request_id, name=name, text=result.text, is_error=result.is_error,
                            truncated=result.truncated, total_chars=result.total_chars, ms=_ms(start))

    @staticmethod
    def cancelled(request_id: str, name: str, start: float) -> p.ToolResult:
        """The answer to a call the user stopped (its task is cancelled; the SDK then tells the server)."""
        return p.ToolResult(id=request_id, name=name, text="the call was stopped by the user before it finished",
                            is_error=True, error="cancelled", ms=_ms(start))


def closed(schema: Any) -> Any:
    """A tool's input schema with every object that lists its properties and says nothing of others closed to them
    (`additionalProperties: false`), so the grammar lets the model write only the arguments the tool declares (a
    schema from a Python signature leaves it open, and a sampled model then invents keys). Schemas are bounded by
    the listing (webchat.mcp.listing: depth 32, 16,000 characters)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("const", "enum", "default", "examples") else closed(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _ms(start: float) -> float:
    return round((time.monotonic() - start) * 1000, 1)
