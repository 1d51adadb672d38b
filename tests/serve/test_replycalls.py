"""A websocket reply's calls (done.tool_calls): in each chat format, however its text streams, each call's span is
its text with its markup, and the text outside the spans is the reply's words."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from webchat.engine import events as ev
from webchat.serve.replycalls import ReplyCalls
from webchat.text.toolformat import GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormat

HERMES_TWO = ('Let me check. <tool_call>\n{"name": "t__now", "arguments": {}}\n</tool_call>\n'
              '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call> Done.')
CASES = [
    (HERMES, HERMES_TWO, ["t__now", "w"], "Let me check. \n Done."),
    (GENERIC, '<tool_call>{"name": "a", "arguments": {"s": "}</tool_call>"}}</tool_call>', ["a"], ""),
    (LLAMA3, '{"name": "now", "parameters": {"a": 1}}', ["now"], ""),
    (LLAMA3, '<|python_tag|>{"name": "x", "parameters": {}}; {"name": "y", "parameters": {}}', ["x", "y"], ""),
    (MISTRAL, 'Hi [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": "}"}}]', ["a", "b"],
     "Hi "),
]


def tokens(text: str) -> ev.Tokens:
    return ev.Tokens(text=text, tokens=[])  # text only: all of it is the answer


def outside(text: str, calls: list[dict[str, object]]) -> str:
    out, at = "", 0
    for call in calls:
        start, end = call["span"]  # type: ignore[misc]
        out, at = out + text[at:start], end
    return out + text[at:]


@pytest.mark.parametrize(("fmt", "text", "names", "words"), CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_spans_hold_each_call_whatever_the_pieces(fmt: ToolFormat, text: str, names: list[str], words: str,
                                                  step: int) -> None:  # fmt: skip
    calls = ReplyCalls(fmt)
    for i in range(0, len(text), step):
        calls.see(tokens(text[i : i + step]))
    found = calls.finish()
    assert [c["function"]["name"] for c in found] == names  # type: ignore[index]
    assert outside(text, found) == words
    for call in found:
        start, end = call["span"]  # type: ignore[misc]
        body = text[start:end]
        assert json.loads(call["function"]["arguments"]) is not None  # type: ignore[index]
        assert call["function"]["name"] in body  # type: ignore[index]


def test_a_call_cut_short_keeps_its_span_to_the_end() -> None:
    text = 'cut <tool_call>\n{"name": "t__now", "arguments": {"x": "ab'
    calls = ReplyCalls(HERMES)
    calls.see(tokens(text))
    [call] = calls.finish()
    assert call["span"] == [4, len(text)] and call["function"]["arguments"] == '{"x": "ab'  # type: ignore[index]


def test_a_continued_reply_counts_its_kept_text() -> None:
    kept = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1'
    calls = ReplyCalls(HERMES, kept=kept)
    calls.see(tokens(', "b": 2}}\n</tool_call>'))
    [call] = calls.finish()
    assert call["span"] == [6, len(kept) + 23] and call["function"]["arguments"] == '{"a": 1, "b": 2}'  # type: ignore


def test_thinking_is_never_a_call() -> None:
    calls = ReplyCalls(HERMES)
    thought = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    calls.see(ev.Tokens(text=thought, tokens=[ev.TokenInfo(id=1, piece=thought, part="thinking")]))
    assert calls.finish() == []


def test_the_server_and_the_cli_import_no_mcp_sdk_without_the_flag() -> None:
    code = ("import sys, webchat.cli.main, webchat.cli.serve, webchat.serve.app, webchat.serve.ws; "
            "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'mcp_types'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
