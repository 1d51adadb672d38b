"""How a model writes tool calls (its chat format), read from its chat template, and how a chat with tools reaches it.

    fmt = detect(template)                       # HERMES (Qwen2.5/3, Hermes), LLAMA3, MISTRAL, or GENERIC
    messages = for_template(fmt, messages, tools)  # calls and results in the shape the template reads
    fmt.in_template                              # tools go to the template's `tools`; GENERIC: a system prompt

A template that renders `tools` and shows one of the known call markers is that format; any other template (SmolLM2's
renders no tools) gets GENERIC: the tools described in a system prompt, calls written as Hermes' `<tool_call>` blocks
(the format llama.cpp's and vLLM's Hermes parsers read; SmolLM2 was tuned on a close variant).
webchat.text.toolparse parses a reply in each format; serve/tools.py builds the grammar that enforces it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    """One chat format's tool calls: `open` starts a block of calls (`at_start`: only at the start of the reply, where
    a bare JSON object is a call too), calls inside a block are split by `separators`, `close` ends the block;
    `repeat`: text and further blocks may follow one."""

    name: str
    open: str
    close: str
    separators: str
    repeat: bool
    at_start: bool
    args_key: str  # the key the model writes the arguments under
    in_template: bool  # the chat template renders `tools` (else a system prompt describes them)

    @property
    def args_keys(self) -> tuple[str, ...]:
        return (self.args_key, "parameters" if self.args_key == "arguments" else "arguments")


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "", True, False, "arguments", True)
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", "", ";", False, True, "parameters", True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "]", ",", False, False, "arguments", True)
GENERIC = ToolFormat("generic", "<tool_call>", "</tool_call>", "", True, False, "arguments", False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GENERIC)}


def detect(template: str | None) -> ToolFormat:
    """The tool-call format a chat template speaks (llama.cpp's common_chat_templates: by the markers it writes)."""
    if template is None or not re.search(r"\btools\b", template):
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|start_header_id|>" in template and ('"parameters"' in template or "<|python_tag|>" in template):
        return LLAMA3
    return GENERIC


def call_text(fmt: ToolFormat, name: str, arguments: Any) -> str:
    """One call as the model writes it in `fmt` (a generic history's assistant turn; a remote engine's calls)."""
    body = json.dumps({"name": name, fmt.args_key: arguments}, ensure_ascii=False)
    return f"{fmt.open}\n{body}\n{fmt.close}"


def arguments_value(arguments: str) -> Any:
    """A call's arguments as templates read them: the parsed JSON object (Llama and Qwen write it with tojson), or
    the string as sent when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def for_template(fmt: ToolFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 ) -> list[dict[str, Any]]:  # fmt: skip
    """OpenAI-shaped messages (assistant `tool_calls` with JSON-string arguments, `tool` results with their
    `tool_call_id`) as the template reads them; GENERIC: calls as `<tool_call>` text, results as user turns, and the
    tools described in the system message."""
    out = [_native(m) for m in messages] if fmt.in_template else _generic(messages)
    if not fmt.in_template and tools:
        prompt = generic_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _native(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if v is not None and k != "tool_calls"}
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": arguments_value(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
    return out


def _generic(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
            continue
        calls = [call_text(GENERIC, c["function"]["name"], arguments_value(c["function"]["arguments"]))
                 for c in m.get("tool_calls") or []]
        out.append({"role": m["role"], "content": "\n".join(([content] if content else []) + calls)})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def generic_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools, for a template that does not render them (Qwen's and Hermes' wording: what such models saw)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")
