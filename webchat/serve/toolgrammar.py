"""The grammar that enforces a tool choice in a chat format (webchat.text.toolformat), in llguidance's Lark dialect.

    required / a named function:  the reply is the format's call block(s) from its first token
    auto:                         any text; once the format's opening marker appears the call must follow (the
                                  lazy grammar of llama.cpp #9639: llguidance's lazy lexeme ends at the marker)

Each call is `%json` of {"name": const, <args key>: the tool's parameters schema}, one alternative per tool; a marker
that is one special token of the vocabulary (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`) is that token
(`<[id]>`), never its characters spelt out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from webchat.grammar.build import WHITESPACE, interoperable, lark
from webchat.text.toolformat import ToolFormat

SP = r"/[ \t\r\n]{0,4}/"  # between markers and calls: a newline or two, not a run


def call_schema(fmt: ToolFormat, fn: dict[str, Any]) -> dict[str, Any]:
    """One call to function `fn` ({name, parameters}) as the format writes it."""
    params = interoperable(fn.get("parameters") or {"type": "object", "properties": {}})
    props: dict[str, Any] = {"name": {"const": fn["name"]}, fmt.args_key: params}
    if fmt.name == "mistral":  # Mistral's models write the call's id after its arguments
        props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
    return {"type": "object", "properties": props, "required": ["name", fmt.args_key], "additionalProperties": False}


def tool_grammar(fmt: ToolFormat, functions: list[dict[str, Any]], required: bool, parallel: bool,
                 special: Callable[[str], int | None]) -> str:  # fmt: skip
    """The llguidance grammar for calls to `functions` in `fmt`: forced from the start (required) or lazy (auto)."""
    schemas = [call_schema(fmt, f) for f in functions]
    body: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = "%json " + json.dumps({"x-guidance": {"whitespace_pattern": WHITESPACE, "lenient": False}, **body})
    tag = special(fmt.open) if fmt.open else None
    opener = f"<[{tag}]>" if tag is not None else json.dumps(fmt.open)
    sep = f' {SP} "{fmt.separators[0]}" {SP} call' if fmt.separators else ""
    calls = f"call ({sep.strip()})*" if sep and parallel else "call"
    if fmt.at_start:  # Llama 3: a reply that is a JSON call (or the python tag and one)
        block = f"{opener} {SP} {calls}" if tag is not None else calls
        rules = [f"start: {SP} {calls}" if required else f"start: TEXT | {SP} {calls}" + (
            f" | {block}" if tag is not None else ""),
                 r"TEXT: /(.|\n)*/ & ~/[ \t\r\n]*(\{|<)(?s:.*)/"]
    else:
        close = f' {SP} {json.dumps(fmt.close)}' if fmt.close else ""
        inner = f'"[" {SP} {calls}' if fmt.separators else "call"  # Mistral: a JSON list of calls, `]` its close
        block = f"{opener} {SP} {inner}{close}"
        if required:
            rules = [f"start: block ({SP} block)*" if parallel and fmt.repeat else "start: block", f"block: {block}"]
        else:
            rules = _lazy(fmt, opener, tag is not None, inner + close, parallel and fmt.repeat)
    return lark("%llguidance {}\n" + "\n".join(rules) + f"\ncall: {call}\n")


def _lazy(fmt: ToolFormat, opener: str, special: bool, rest: str, repeat: bool) -> list[str]:
    """Text, then (where the opening marker appears) the call: a lazy lexeme that ends at the marker."""
    start = "start: seg* TEXT" if repeat else "start: TEXT | seg"
    if special:  # a special token cannot occur inside text: the text before it is a plain lexeme
        return [start, f"seg: TEXT {opener} {SP} {rest}", r"TEXT: /(.|\n)*/"]
    marker = re.escape(fmt.open).replace("/", r"\/")
    return [start, f"seg_open[lazy]: TEXT {opener}", f"seg: seg_open {SP} {rest}",
            rf"TEXT: /(.|\n)*/ & ~/(?s:.*){marker}(?s:.*)/"]
