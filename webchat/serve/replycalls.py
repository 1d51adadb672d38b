"""A websocket reply's tool calls (issue 66): its answer parsed as it streams by the one parser of its chat format
(webchat.text.toolparse), then `done.tool_calls`: each call in OpenAI's shape with `span`, where its text (markup
included) lies in the reply's answer, so the page shows the text outside the spans as the reply and each span's
tokens, coloured by probability, as its call.

    calls = ReplyCalls(fmt, kept="")       # kept: a continued reply's answer so far (spans count from its start)
    calls.see(event)                       # each Tokens event's answer text
    calls.finish() -> [{"id", "type": "function", "function": {"name", "arguments"}, "span": [start, end]}]
"""

from __future__ import annotations

from typing import Any

from webchat.engine import events as ev
from webchat.text.thinking import split_text
from webchat.text.thinking_split import Thinking
from webchat.text.toolformat import ToolFormat
from webchat.text.toolparse import Delta, ToolCallParser


class ReplyCalls:
    """One reply's calls: names and argument text as the model wrote them, and where each one is."""

    def __init__(self, fmt: ToolFormat, kept: str = "") -> None:
        self.parser = ToolCallParser(fmt)
        self.calls: list[dict[str, Any]] = []
        if kept:
            self._take(self.parser.feed(kept))

    def see(self, event: ev.Event) -> None:
        """A worker event of the reply: its answer's text is parsed (thinking is never a call)."""
        if isinstance(event, ev.Tokens) and event.answer:
            self._take(self.parser.feed(event.answer))

    def finish(self) -> list[dict[str, Any]]:
        """Every call of the reply (one cut short keeps what it has), each with its span in the answer."""
        self._take(self.parser.finish())
        return [{**call, "span": list(span)} for call, span in zip(self.calls, self.parser.spans, strict=True)]

    def _take(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if d.index < 0:
                continue
            if d.name is not None:
                self.calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            self.calls[d.index]["function"]["arguments"] += d.arguments


def kept_answer(final: str, thinking: Thinking | None) -> str:
    """The answer part of a continued reply's text as the page sent it (what the model wrote, markers included)."""
    return final if thinking is None else split_text(final, thinking.markers)[1]
