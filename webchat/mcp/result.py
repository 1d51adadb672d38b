"""What a tool call gives back: a ToolResult of plain text, or a ToolCallError that names what went wrong.

A result is text only, whatever the server sent: text parts joined with newlines, an image, audio or resource
described by its type and size, structured content as JSON when no text came with it. The text is kept exactly as
sent (HTML stays the characters `<`, `>`, `&`; only a lone surrogate becomes U+FFFD so the text can be encoded);
escaping is the page's, which puts it in the DOM through `textContent`. Past `max_chars` it is cut, with a note.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from mcp_types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
)

DEFAULT_MAX_RESULT_CHARS = 16_000  # about 4,000 tokens: a small model's context is 8k
LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")

ErrorKind = Literal[
    "unknown_tool",  # no tool of that qualified name in the current listing
    "bad_arguments",  # the arguments are not a JSON object
    "unavailable",  # the server is not connected (it failed to start, or is between restarts) or is disabled
    "timeout",  # no answer within the call's time limit; the server was told to cancel
    "server_died",  # the connection ended during the call (the process exited, the HTTP stream broke)
    "too_large",  # one message from the server was past the transport's limit (MAX_MESSAGE_BYTES)
    "server_error",  # the server answered a JSON-RPC error (an unknown tool on its side, invalid params, ...)
    "protocol",  # the answer was not a valid tools/call result (or asked for input webchat does not give)
]


class ToolCallError(Exception):
    """A call that produced no result; `kind` says why, the message (for the user and the model) names the server."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer as plain text; `is_error`: the tool itself reported a failure (the model should see it)."""

    text: str
    is_error: bool = False
    truncated: bool = False
    total_chars: int = 0  # the text's length before any cut
    media_type: Literal["text/plain"] = "text/plain"  # never HTML: the page shows it with textContent


def to_tool_result(result: CallToolResult, max_chars: int = DEFAULT_MAX_RESULT_CHARS) -> ToolResult:
    """`result` as text, cut to `max_chars` characters (and a note saying how long it was) past that."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    parts = [describe_part(part) for part in result.content]
    if not any(isinstance(part, TextContent) for part in result.content) and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    total = len(text)
    truncated = total > max_chars
    if truncated:
        note = f"[truncated: the result was {total:,} characters; the first {max_chars:,} are above]"
        text = f"{text[:max_chars]}\n{note}"
    return ToolResult(LONE_SURROGATE.sub("\ufffd", text), result.is_error, truncated, total)


def describe_part(part: ContentBlock) -> str:
    """One content part as text: text as it is, anything else as a bracketed line naming its type and size."""
    if isinstance(part, TextContent):
        return part.text
    if isinstance(part, ImageContent | AudioContent):
        return f"[{part.type}: {part.mime_type}, {base64_size(part.data):,} bytes]"
    if isinstance(part, EmbeddedResource):
        res = part.resource
        if isinstance(res, BlobResourceContents):
            return f"[resource {res.uri}: {res.mime_type or 'binary'}, {base64_size(res.blob):,} bytes]"
        return f"[resource {res.uri}: {res.mime_type or 'text'}, {len(res.text):,} characters]"
    if isinstance(part, ResourceLink):
        size = f", {part.size:,} bytes" if part.size is not None else ""
        return f"[resource link {part.uri}: {part.name}{size}]"
    raise AssertionError(f"unexpected content part {type(part).__name__}")


def base64_size(data: str) -> int:
    """The number of bytes a base64 text decodes to (without decoding it)."""
    return len(data) * 3 // 4 - data[-2:].count("=")
