"""A reply's format on both wires (the API's `response_format`, the websocket's `generate.response_format`): text,
any JSON object, or instances of a JSON schema, enforced by a grammar (webchat.engine.grammar) as the reply is drawn.

    fmt = ResponseFormat(type="json_schema", json_schema={"name": "person", "schema": {...}})
    grammar = format_grammar(fmt, field)          # None for text; RuleError naming an unsupported keyword
    constraint = await make_constraint(tokenizer, vocab, grammar, field, replay=ids)   # on a compiler thread

Both build on the grammar compiler's threads (webchat.grammar.compiler), never on the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from webchat.engine.constraint import ConstraintError
from webchat.grammar.bounds import GrammarError, GrammarLimit, check_lark, check_regex, check_schema
from webchat.grammar.build import ANY_JSON_OBJECT, json_schema, validate
from webchat.grammar.compiler import compiler
from webchat.grammar.matcher import GrammarConstraint, grammars_for
from webchat.serve.rules import RuleError
from webchat.text.tokenizer import Tokenizer

T = TypeVar("T")
MAX_SCHEMA_CHARS = 256 * 1024  # a schema's JSON text (llguidance handles megabytes; a reply format needs little)


class JsonSchemaSpec(BaseModel):
    """OpenAI's `json_schema`: the schema and its name; `strict` is accepted (the grammar always enforces it)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)] = "reply"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


def format_grammar(fmt: ResponseFormat | None, field: str) -> str | None:
    """The grammar of a reply format (None: free text); RuleError(field) when it cannot be one."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise RuleError(field, f"{field}.json_schema is only allowed with type 'json_schema', got type 'text'")
        return None
    if fmt.type == "json_object":
        return ANY_JSON_OBJECT
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RuleError(f"{field}.json_schema.schema", f"type 'json_schema' needs {field}.json_schema.schema, "
                        "got none")
    return schema_grammar(fmt.json_schema.schema_, f"{field}.json_schema.schema")


def schema_grammar(schema: dict[str, Any] | bool, field: str) -> str:
    """A JSON schema's grammar; RuleError(field) naming a bound it is past or what llguidance could not read (call it
    on a compiler thread: webchat.grammar.compiler)."""
    try:
        size = len(json.dumps(schema))
    except RecursionError:
        size = MAX_SCHEMA_CHARS + 1  # nested past what any schema needs: refused below by its nesting
    if size > MAX_SCHEMA_CHARS:
        raise RuleError(field, f"the schema is {size} characters of JSON; at most {MAX_SCHEMA_CHARS} are allowed")
    try:
        grammar = json_schema(schema, field)
        validate(grammar)
        return grammar
    except GrammarError as exc:
        raise RuleError(field, str(exc)) from None


async def grammar_work(fn: Callable[..., T], *args: Any, field: str) -> T:
    """fn(*args), work that builds or checks grammars (format_grammar, a request's tools), on a compiler thread;
    RuleError(field) when it passes the compiler's deadline (its own RuleErrors pass through)."""
    try:
        return await compiler().run(fn, *args)
    except GrammarError as exc:
        raise RuleError(field, f"{field}: {exc}") from None


def upstream_bounds(fields: dict[str, Any]) -> None:
    """The bounds of webchat.grammar.bounds on what a remote engine is sent as the client sent it (a reply format,
    structured outputs, tools): RuleError naming the field, before anything goes upstream."""
    fmt = fields.get("response_format") or {}
    schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt, dict) else None
    structured = fields.get("structured_outputs") or {}
    try:
        if isinstance(schema, dict):
            check_schema(schema, "response_format.json_schema.schema")
        if isinstance(structured, dict):
            if isinstance(structured.get("json"), dict):
                check_schema(structured["json"], "structured_outputs.json")
            if isinstance(structured.get("regex"), str):
                check_regex(structured["regex"], "structured_outputs.regex")
            if isinstance(structured.get("grammar"), str):
                check_lark(structured["grammar"], "structured_outputs.grammar")
        for i, tool in enumerate(fields.get("tools") or []):
            params = (tool.get("function") or {}).get("parameters") if isinstance(tool, dict) else None
            if isinstance(params, dict):
                check_schema(params, f"tools.{i}.function.parameters")
    except GrammarLimit as exc:
        field = str(exc).split(":", 1)[0].split(" ", 1)[0]
        raise RuleError(field, str(exc)) from None


def kept_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A kept reply's text as tokens to replay into a grammar (its bytes are what matter: any tokenization will do),
    without the BOS a tokenizer may add."""
    ids = tokenizer.encode_text(text)
    return ids[1:] if tokenizer.add_bos_token and ids[:1] == [tokenizer.bos_id] else ids


async def make_constraint(tokenizer: Tokenizer, vocab_size: int, grammar: str | None, field: str,
                          replay: list[int] | None = None) -> GrammarConstraint | None:  # fmt: skip
    """The request's constraint on the runtime's tokenizer, built on a compiler thread (the tokenizer's grammar table
    takes ~0.3 s the first time, a large schema a good part of a second): RuleError(field) when the library refuses
    the grammar (an unsupported JSON Schema keyword: `Unimplemented keys: ["if"]`), it fails its first steps, its
    compile passes the deadline, or the kept tokens do not follow it."""
    if grammar is None:
        return None

    def build() -> GrammarConstraint:
        grammars = grammars_for(tokenizer, vocab_size)
        grammars.check(grammar)
        constraint = grammars.constraint(grammar)
        if replay:
            constraint.replay(replay)
        return constraint

    try:
        return await compiler().run(build)
    except (GrammarError, ConstraintError) as exc:
        raise RuleError(field, f"{field}: {exc}") from None
