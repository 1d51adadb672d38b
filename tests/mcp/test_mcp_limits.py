"""The limits that need no server: a hostile listing (10,000 tools, huge or deep schemas), a result as text, cut."""

from __future__ import annotations

import base64
from typing import Any

from mcp_types import (
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    Tool,
)

from webchat.mcp.listing import MAX_DESCRIPTION_CHARS, MAX_SCHEMA_CHARS, MAX_TOOLS, select_tools
from webchat.mcp.manager import arguments_problem
from webchat.mcp.result import to_tool_result

OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def tool(name: str, schema: dict[str, Any] | None = None, description: str = "") -> Tool:
    return Tool(name=name, input_schema=schema or OBJECT, description=description)


def test_a_listing_of_10000_tools_keeps_the_first_128_and_says_so() -> None:
    listing = select_tools("big", [tool(f"t{i}") for i in range(10_000)])
    assert len(listing.tools) == MAX_TOOLS
    assert listing.tools[-1].qualified_name == f"big__t{MAX_TOOLS - 1}"
    assert listing.notes == (f"listed more than {MAX_TOOLS} tools; the first {MAX_TOOLS} are kept",)
    assert select_tools("big", [tool("a")], more=True).notes == ("had more pages of tools than the 16 read",)


def test_schemas_too_long_too_deep_or_not_objects_are_left_out_and_long_descriptions_cut() -> None:
    deep: dict[str, Any] = {"type": "object"}
    node = deep
    for _ in range(40):
        node["properties"] = {"x": {"type": "object"}}
        node = node["properties"]["x"]
    huge = {"type": "object", "description": "d" * MAX_SCHEMA_CHARS}
    tools = [tool("ok", description="é" * (MAX_DESCRIPTION_CHARS + 5)), tool("deep", deep), tool("huge", huge),
             tool("array", {"type": "array"}), tool("fine")]
    listing = select_tools("s", tools)
    assert [t.name for t in listing.tools] == ["ok", "fine"]
    assert len(listing.tools[0].description) == MAX_DESCRIPTION_CHARS and listing.tools[0].description[-1] == "…"
    assert listing.notes == (
        "1 tool description(s) cut to 2,000 characters",
        "left out 'deep': the input schema is nested deeper than 32",
        "left out 'huge': the input schema is longer than 16,000 characters",
        "left out 'array': the input schema is not an object schema",
    )


def test_a_result_is_text_each_part_described_and_cut_with_a_note() -> None:
    png = base64.b64encode(bytes(300)).decode()
    result = CallToolResult(content=[
        TextContent(text="<b>x</b> & \ud800"),
        ImageContent(data=png, mime_type="image/png"),
        EmbeddedResource(resource=BlobResourceContents(uri="file:///a.bin", blob=base64.b64encode(b"abcd").decode())),
        ResourceLink(uri="file:///r.txt", name="r.txt", size=12),
    ])
    text = to_tool_result(result).text
    assert text.split("\n") == ["<b>x</b> & \ufffd", "[image: image/png, 300 bytes]",
                                "[resource file:///a.bin: binary, 4 bytes]",
                                "[resource link file:///r.txt: r.txt, 12 bytes]"]
    structured = to_tool_result(CallToolResult(content=[], structured_content={"temp": 21.5}))
    assert structured.text == '{"temp": 21.5}'
    cut = to_tool_result(CallToolResult(content=[TextContent(text="abcdef")], is_error=True), max_chars=4)
    assert (cut.text, cut.is_error, cut.truncated, cut.total_chars) == (
        "abcd\n[truncated: the result was 6 characters; the first 4 are above]", True, True, 6)


def test_arguments_must_be_a_json_object() -> None:
    assert arguments_problem({"q": "x", "n": [1, {"a": None}]}) is None
    assert arguments_problem(["q"]) == "must be a JSON object, got list"
    assert arguments_problem({1: "x"}) == "must be a JSON object, got dict"
    assert arguments_problem({"x": float("inf")}) is not None
    assert arguments_problem({"x": object()}) is not None
