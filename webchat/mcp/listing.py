"""A server's tools as the model will see them, with limits: a hostile server could list 10,000 tools or a schema of
megabytes, and the whole list goes into every prompt that has tools switched on.

Kept per server: the first MAX_TOOLS tools (read over at most MAX_PAGES pages); a description cut to
MAX_DESCRIPTION_CHARS; a tool is left out when its input schema is not a JSON object schema, is nested deeper than
MAX_SCHEMA_DEPTH or is longer than MAX_SCHEMA_CHARS as JSON. What was left out is said in `notes` (the status shows it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcp import Client
from mcp_types import Tool

from webchat.mcp.names import qualify
from webchat.mcp.result import LONE_SURROGATE

MAX_TOOLS = 128  # per server; also OpenAI's limit on the tools of one request
MAX_PAGES = 16
MAX_SCHEMA_CHARS = 16_000
MAX_SCHEMA_DEPTH = 32
MAX_DESCRIPTION_CHARS = 2_000


@dataclass(frozen=True)
class McpTool:
    """One tool: its server, its name there, the qualified name the model calls it by, and what the model is told."""

    server: str
    name: str
    qualified_name: str
    description: str
    input_schema: dict[str, Any]
    title: str | None = None

    def as_function(self) -> dict[str, Any]:
        """The tool as a chat template's `tools` and OpenAI's API take it."""
        return {"type": "function", "function": {"name": self.qualified_name, "description": self.description,
                                                 "parameters": self.input_schema}}


@dataclass(frozen=True)
class Listing:
    """A server's tools as kept, and what was left out or cut (one line each)."""

    tools: tuple[McpTool, ...] = ()
    notes: tuple[str, ...] = ()


async def list_tools(client: Client, server: str) -> Listing:
    """Every page of the server's `tools/list`, until MAX_TOOLS are read or MAX_PAGES pages, then `select_tools`."""
    tools: list[Tool] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None or len(tools) > MAX_TOOLS:
            break
    return select_tools(server, tools, more=cursor is not None)


def select_tools(server: str, tools: Sequence[Tool], more: bool = False) -> Listing:
    """The tools kept of a listing (`more`: the server had pages left unread), each with its qualified name."""
    kept: list[McpTool] = []
    notes: list[str] = []
    taken: set[str] = set()
    dropped: dict[str, list[str]] = {}
    cut = 0
    for tool in tools:
        if len(kept) == MAX_TOOLS:
            notes.append(f"listed more than {MAX_TOOLS} tools; the first {MAX_TOOLS} are kept")
            break
        problem = schema_problem(tool.input_schema)
        if problem:
            dropped.setdefault(problem, []).append(tool.name)
            continue
        description = LONE_SURROGATE.sub("\ufffd", tool.description or "")
        if len(description) > MAX_DESCRIPTION_CHARS:
            description = description[: MAX_DESCRIPTION_CHARS - 1] + "…"
            cut += 1
        kept.append(McpTool(server, tool.name, qualify(server, tool.name, taken), description, tool.input_schema,
                            tool.title))
    else:
        if more:
            notes.append(f"had more pages of tools than the {MAX_PAGES} read")
    if cut:
        notes.append(f"{cut} tool description(s) cut to {MAX_DESCRIPTION_CHARS:,} characters")
    for problem, names in dropped.items():
        shown = ", ".join(repr(n[:64]) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        notes.append(f"left out {shown}: {problem}")
    return Listing(tuple(kept), tuple(notes))


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why an input schema cannot be given to the model (None when it can)."""
    if schema.get("type") != "object":
        return "the input schema is not an object schema"
    if depth(schema) > MAX_SCHEMA_DEPTH:
        return f"the input schema is nested deeper than {MAX_SCHEMA_DEPTH}"
    if len(json.dumps(schema, ensure_ascii=False)) > MAX_SCHEMA_CHARS:
        return f"the input schema is longer than {MAX_SCHEMA_CHARS:,} characters"
    return None


def depth(value: Any) -> int:
    """How deeply objects and lists nest in a JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            level += 1
            deepest = max(deepest, level)
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
            stack.extend((child, level) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
