"""Tool calls in the chat formats of real templates (llama.cpp's models/templates: Qwen3, Hermes 3, Llama 3.1/3.3,
Mistral Nemo): the format read from the template, a tool conversation rendered through it, a reply in that format
parsed into the same calls whole and streamed in any split, and the grammar that enforces the format accepting the
reply (and refusing a call to a tool that does not exist)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from webchat.grammar import matcher as gm
from webchat.serve.rules import RuleError
from webchat.serve.toolgrammar import tool_grammar
from webchat.serve.tools import ToolCalls, Tools, chat_tools
from webchat.text.tokenizer import Tokenizer, render_chat_template
from webchat.text.toolformat import GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormat, detect

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}
ADD = {"name": "add", "description": "a + b", "parameters": {"type": "object", "properties": {
    "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
CASES: dict[str, tuple[ToolFormat, str, list[tuple[str, dict[str, Any]]], str]] = {
    # template: (format, a reply as the model writes it, its calls, its content)
    "Qwen-Qwen3-0.6B": (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                        '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": '
                        '3.5}}\n</tool_call>', [("get_weather", {"city": "Paris", "unit": "C"}),
                                                ("add", {"a": 2, "b": 3.5})], "Let me look.\n"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (
        HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "{Pa}ri\\"s"}}\n</tool_call>',
        [("get_weather", {"city": '{Pa}ri"s'})], ""),
    "meta-llama-Llama-3.3-70B-Instruct": (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                                          [("get_weather", {"city": "Oslo"})], ""),
    "mistralai-Mistral-Nemo-Instruct-2407": (
        MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "a1b2c3d4e"}, '
                 '{"name": "add", "arguments": {"a": 1, "b": 2}}]', [("get_weather", {"city": "Rome"}),
                                                                      ("add", {"a": 1, "b": 2})], ""),
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def parse(fmt: ToolFormat, text: str, splits: random.Random | None) -> tuple[str, list[dict[str, Any]], list[Any]]:
    """(content, calls, the raw deltas) of a reply fed whole or in random pieces of 1-7 characters."""
    calls = ToolCalls(fmt)
    deltas: list[Any] = []
    i = 0
    while i < len(text):
        n = len(text) if splits is None else splits.randint(1, 7)
        deltas += calls.feed(text[i : i + n])[1]
        i += n
    deltas += calls.finish()[1]
    return calls.content, calls.calls, deltas


@pytest.mark.parametrize("name", list(CASES))
def test_the_format_is_read_from_the_template(name: str) -> None:
    assert detect(template(name)) is CASES[name][0]
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is GENERIC  # SmolLM2's: no tools


@pytest.mark.parametrize("name", list(CASES))
def test_a_reply_parses_to_the_same_calls_whole_and_streamed(name: str) -> None:
    fmt, reply, want, content = CASES[name]
    whole = parse(fmt, reply, None)
    assert whole[0] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole[1]] == want
    ids = [c["id"] for c in whole[1]]
    assert len(set(ids)) == len(ids) and all(len(i) == 9 for i in ids) == (fmt is MISTRAL)
    for seed in range(30):
        content_s, calls_s, deltas = parse(fmt, reply, random.Random(seed))
        assert content_s == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls_s] == \
               [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]]
        firsts = [d for d in deltas if "id" in d]  # one id per call, the name once, on the call's first delta
        assert [d["index"] for d in firsts] == list(range(len(want)))
        assert all(d["function"]["name"] for d in firsts)
        assert all("name" not in d["function"] for d in deltas if "id" not in d)


def test_text_that_only_looks_like_a_call_is_content() -> None:
    for fmt, text in [(HERMES, "a <tool_ca b < c"), (LLAMA3, 'Hi {"name": "x"}'), (MISTRAL, "[TOOL_CALL]s")]:
        content, calls, _ = parse(fmt, text, random.Random(1))
        assert (content, calls) == (text, [])


def test_a_call_cut_short_keeps_its_name_and_the_arguments_so_far() -> None:
    content, calls, _ = parse(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None)
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    for cut in (call[:-10], call + "\n<tool"):  # cut inside the closing marker, inside the next opening one
        for splits in (None, random.Random(0)):
            content, calls, _ = parse(HERMES, cut, splits)
            assert content == "" and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


@pytest.mark.parametrize("name", list(CASES))
def test_a_tool_conversation_renders_through_the_template(name: str) -> None:
    """Tools in the template's `tools`, an assistant call with content null and its result in the history."""
    fmt = CASES[name][0]
    call_id = "a1b2c3d4e"  # Mistral's template wants 9 letters and digits
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": '{"temp": 21, "sky": "clear"}', "tool_call_id": call_id}]
    messages, tools, plan = chat_tools(history, Tools([_tool(t) for t in TOOLS]), template(name), lambda s: None)
    assert plan is not None and plan.fmt is fmt and tools == TOOLS
    text = render_chat_template(template(name), messages, True, tools=tools, bos_token="<s>", eos_token="</s>")
    assert "get_weather" in text and "Paris" in text and "21" in text
    assert "The weather in a city" in text  # the tool's description reached the model


def test_a_template_without_tools_gets_the_generic_prompt_and_history(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    history = [{"role": "user", "content": "2+3?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
               {"role": "tool", "content": "5", "tool_call_id": "call_1"}]
    messages, tools, plan = chat_tools(history, Tools([_tool(t) for t in TOOLS], "auto"), tok.chat_template,
                                       tok.control_id)
    assert plan is not None and plan.fmt is GENERIC and tools is None
    text = tok.apply_chat_template(messages)
    assert "<tools>" in text and '"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    ids = tok.encode_chat(messages)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("required", [True, False], ids=["required", "auto"])
def test_the_grammar_accepts_the_formats_calls_and_refuses_others(tiny_model_dir: Path, name: str,
                                                                  required: bool) -> None:
    fmt, reply, _, content = CASES[name]
    tok = Tokenizer.from_dir(tiny_model_dir)
    grammars = gm.grammars_for(tok, tok.vocab_size)
    grammar = tool_grammar(fmt, [WEATHER, ADD], required, True, tok.control_id)
    grammars.check(grammar)
    expect = not (required and content)  # required: the calls come first, no text before them

    def accepts(text: str) -> bool:
        m = grammars.constraint(grammar).matcher
        ids = tok.encode_text(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert accepts(reply) == expect
    assert not accepts(reply.replace("get_weather", "get_wether").replace('"add"', '"sub"'))
    assert accepts("Just an answer, no call.") == (not required)


def test_tool_choice_errors_name_the_field() -> None:
    tools = [_tool(t) for t in TOOLS]
    from webchat.serve.tools import NamedChoice, plan_tools

    with pytest.raises(RuleError, match="not one of the tools") as info:
        plan_tools(tools, NamedChoice.model_validate({"type": "function", "function": {"name": "nope"}}), None,
                   HERMES, lambda s: None)
    assert info.value.field == "tool_choice"
    bad = _tool({"name": "f", "parameters": {"type": "object", "if": {}}})
    with pytest.raises(RuleError, match="Unimplemented keys") as info:
        plan_tools([bad], "auto", None, HERMES, lambda s: None)
    assert info.value.field == "tools.0.function.parameters"


def _tool(t: dict[str, Any]) -> Any:
    from webchat.serve.tools import Tool

    return Tool.model_validate(t if "type" in t else {"type": "function", "function": t})
