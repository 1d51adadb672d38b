"""Tools on the chat endpoint (docs/api.md, "Tools"): `tools`, `tool_choice`, `parallel_tool_calls`, the calls and
results in the history, and a reply's calls as `message.tool_calls` / `delta.tool_calls`.

    plan = plan_tools(tools, tool_choice, parallel, fmt, special)   # what the prompt, the grammar and the parser get
    messages = for_template(fmt, history, plan.template_tools or plan.prompt_tools)
    calls = ToolCalls(fmt)  → feed(text) -> (content, [delta dicts]); finish(); message_calls()

`auto` lets the model answer in text and enforces a call once its format's opening marker appears (a lazy grammar);
`required` and a named function enforce calls from the first token; `none` sends no tools and parses nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from webchat.grammar.bounds import GrammarError
from webchat.grammar.build import validate
from webchat.serve.replyformat import schema_grammar
from webchat.serve.rules import RuleError
from webchat.serve.toolgrammar import tool_grammar
from webchat.text.toolformat import ToolFormat, detect, for_template
from webchat.text.toolparse import Delta, ToolCallParser

MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: the grammar always enforces the parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: FunctionName


class NamedChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedChoice


class CallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call in an assistant message of the history."""

    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: CallFunction


@dataclass
class ToolPlan:
    """What a request's tools change: the template's `tools` (or the generic prompt's), the grammar, the parsing."""

    fmt: ToolFormat
    tools: list[dict[str, Any]]  # as the template and the generic prompt read them ({type, function})
    grammar: str
    required: bool = False  # calls from the first token (tool_choice required or a named function): no content


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None, fmt: ToolFormat,
               special: Callable[[str], int | None]) -> ToolPlan | None:  # fmt: skip
    """The plan for a request's tools; None when it sends none (or tool_choice none). RuleError names the field."""
    if choice is not None and not tools:
        raise RuleError("tool_choice", "tool_choice needs tools, got no tools")
    if not tools or choice == "none":
        return None
    if len(tools) > MAX_TOOLS:
        raise RuleError("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise RuleError("tools", f"each tool needs its own name, got {names}")
    for i, t in enumerate(tools):  # each schema checked alone, so an unsupported keyword names its tool
        if t.function.parameters is not None:
            schema_grammar(t.function.parameters, f"tools.{i}.function.parameters")
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    if isinstance(choice, NamedChoice):
        if choice.function.name not in names:
            raise RuleError("tool_choice", f"tool_choice names {choice.function.name!r}, which is not one of the "
                            f"tools {names}")
        picked, required, many = [functions[names.index(choice.function.name)]], True, False
    else:
        picked, required, many = functions, choice == "required", parallel is not False
    grammar = tool_grammar(fmt, picked, required, many, special)
    try:
        validate(grammar)
    except GrammarError as exc:
        raise RuleError("tools", f"tools: {exc}") from None
    return ToolPlan(fmt, [{"type": "function", "function": f} for f in functions], grammar, required)


@dataclass(frozen=True)
class Tools:
    """What a request asks of tools: the functions, the choice, whether calls may come several at once."""

    tools: list[Tool] | None = None
    choice: ToolChoice | None = None
    parallel: bool | None = None


def chat_tools(messages: list[dict[str, Any]], tools: Tools, template: str | None,
               special: Callable[[str], int | None],
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolPlan | None]:  # fmt: skip
    """A chat with tools for a local model: its messages shaped for the template's format, the template's `tools`
    (None when the tools go in the generic system prompt instead), and the plan (None: no tools in play)."""
    fmt = detect(template)
    plan = plan_tools(tools.tools, tools.choice, tools.parallel, fmt, special)
    if plan is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None, None
    shaped = for_template(fmt, messages, plan.tools if plan is not None else None)
    return shaped, plan.tools if plan is not None and fmt.in_template else None, plan


class ToolCalls:
    """One reply's content and calls, parsed as it streams; the same deltas make the whole message. `required`: the
    grammar forces calls from the first token, so no text is content (a reply cut by max_tokens inside its first
    call is that call so far, with finish_reason `length`, never its markup as content)."""

    def __init__(self, fmt: ToolFormat, required: bool = False) -> None:
        self.parser = ToolCallParser(fmt)
        self.required = required
        self.content = ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self._take(self.parser.feed(text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._take(self.parser.finish())

    def _take(self, deltas: list[Delta]) -> tuple[str, list[dict[str, Any]]]:
        """Content text and `delta.tool_calls` entries: a call's first carries its id, type and name."""
        text, entries = "", []
        for d in deltas:
            if d.index < 0:
                text += "" if self.required else d.content
                continue
            if d.name is not None:
                self.calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
                entries.append({"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": d.arguments}})
            else:
                entries.append({"index": d.index, "function": {"arguments": d.arguments}})
            self.calls[d.index]["function"]["arguments"] += d.arguments
        self.content += text
        return text, entries


def upstream_fields(req: Any) -> dict[str, Any] | None:
    """What a remote engine passes on as the client sent it (webchat.serve.remote): the reply format and the tools."""
    names = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")
    out = {}
    for name in names:
        value = getattr(req, name, None)
        if value is not None:
            out[name] = value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else (
                [v.model_dump(by_alias=True, exclude_none=True) for v in value] if isinstance(value, list) else value)
    return out or None
