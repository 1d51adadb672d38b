"""Structured output and tool calls through the official `openai` client (and `instructor`) against `webchat serve`
on the default model: every reply valid under its schema, 20 seeds each, whole and streamed (issue 39's acceptance).
One server for the module; requests run 4 at a time (the engine batches them)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import instructor
import jsonschema
import openai
import pytest
from grammars import SCHEMAS
from live_server import Live, serve  # tests/ is on sys.path under pytest
from pydantic import BaseModel, ConfigDict, Field

from webchat.serve.config import ServerConfig
from webchat.serve.runtime import load_runtime

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]
SEEDS = range(20)
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live(real_model_dir: Path) -> Iterator[Live]:
    config = ServerConfig(model_dir=real_model_dir, device="cpu", max_sessions=4, max_queue=16)
    with serve(config, load_runtime(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def each_seed(fn: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(fn, SEEDS))


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls joined from their deltas, finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: its id and name, once
                assert d.index not in calls and d.function is not None and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function is not None and d.function.name is None
            calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_replies_are_valid(client: openai.OpenAI, model: str, name: str, stream: bool) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}

    def one(seed: int) -> str:
        kwargs: dict[str, Any] = dict(model=model, messages=ASK, response_format=fmt, seed=seed, max_tokens=160)
        if stream:
            text, _, finish = streamed(client, **kwargs)
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content or "", choice.finish_reason
        assert finish == "stop", (seed, text)
        jsonschema.validate(json.loads(text), schema)
        return text

    texts = each_seed(one)
    assert len(set(texts)) > 1  # the seeds sampled different replies, all valid


def test_json_object_replies_are_objects(client: openai.OpenAI, model: str) -> None:
    def one(seed: int) -> None:
        r = client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                           seed=seed, max_tokens=200, temperature=0.7)
        assert r.choices[0].finish_reason in ("stop", "length")
        if r.choices[0].finish_reason == "stop":  # an object may run long: a cut one says "length", never "stop"
            assert isinstance(json.loads(r.choices[0].message.content or ""), dict)

    each_seed(one)


class Person(BaseModel):
    # extra keys forbidden (the schema's additionalProperties: false): otherwise the grammar lets the 135M model add
    # keys of its own, and a sampled reply may run past max_tokens with them, valid JSON and all
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    hobbies: list[Literal["chess", "music", "hiking"]] = Field(min_length=1, max_length=2)


def test_parse_fills_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    def one(seed: int) -> None:
        r = client.chat.completions.parse(model=model, messages=ASK, response_format=Person, seed=seed,
                                          max_tokens=160)
        assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message.content

    each_seed(one)


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_and_named_call_a_tool(client: openai.OpenAI, model: str, choice: str,
                                                    stream: bool) -> None:
    tools = [WEATHER, ADD]
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}

    def one(seed: int) -> None:
        kwargs: dict[str, Any] = dict(model=model, messages=ASK_WEATHER, tools=tools, tool_choice=tool_choice,
                                      seed=seed, max_tokens=120, parallel_tool_calls=False)
        if stream:
            _, calls, finish = streamed(client, **kwargs)
        else:
            r = client.chat.completions.create(**kwargs).choices[0]
            finish = r.finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in r.message.tool_calls or [] if c.type == "function"]
            assert r.message.content is None
        assert finish == "tool_calls" and len(calls) == 1, (seed, calls)
        spec = next(t["function"] for t in tools if t["function"]["name"] == calls[0]["name"])
        assert choice == "required" or spec["name"] == "add"
        jsonschema.validate(json.loads(calls[0]["arguments"]), spec["parameters"])
        assert calls[0]["id"].startswith("call_")

    each_seed(one)


def test_a_tool_result_sent_back_is_answered(client: openai.OpenAI, model: str) -> None:
    def one(seed: int) -> None:
        first = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[WEATHER],
                                               tool_choice="required", seed=seed, max_tokens=120,
                                               parallel_tool_calls=False)
        call = (first.choices[0].message.tool_calls or [])[0]
        assert call.type == "function" and first.choices[0].message.content is None
        sent = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}  # content null, as OpenAI's
        history = [*ASK_WEATHER, sent,
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
        r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], seed=seed, max_tokens=24)
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert (choice.message.content or "").strip() or choice.message.tool_calls

    each_seed(one)


def test_a_reply_cut_by_max_tokens_says_length(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested_lengths"]}}
    r = client.chat.completions.create(model=model, messages=ASK, response_format=fmt, seed=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def test_unsupported_keywords_are_a_400_naming_them(client: openai.OpenAI, model: str) -> None:
    bad = {"type": "object", "if": {"properties": {"a": {"const": 1}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    body: Any = info.value.body
    assert '"if"' in body["message"] and body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, tools=[
            {"type": "function", "function": {"name": "f", "parameters": bad}}])
    body = info.value.body
    assert '"if"' in body["message"] and body["param"] == "tools.0.function.parameters"


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_structured_outputs_on_both_endpoints(client: openai.OpenAI, model: str, kind: str) -> None:
    spec: dict[str, Any] = {"regex": r"[0-9]{3}-[A-Z]{2}"} if kind == "regex" else {"choice": ["red", "blue"]}
    chat = client.chat.completions.create(model=model, messages=ASK, extra_body={"structured_outputs": spec},
                                          max_tokens=20, seed=1)
    text = client.completions.create(model=model, prompt="Answer:", extra_body={"structured_outputs": spec},
                                     max_tokens=20, seed=1)
    for out in (chat.choices[0].message.content or "", text.choices[0].text):
        assert (out in ("red", "blue")) if kind == "choice" else len(out) == 6 and out[3] == "-", out


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS], ids=["json_schema", "tools"])
def test_instructor_fills_a_pydantic_model(client: openai.OpenAI, model: str, mode: instructor.Mode) -> None:
    patched = instructor.from_openai(client, mode=mode)
    for seed in range(3):
        person = patched.chat.completions.create(model=model, response_model=Person, max_retries=0, seed=seed,
                                                 messages=ASK, max_tokens=160)
        assert isinstance(person, Person)
