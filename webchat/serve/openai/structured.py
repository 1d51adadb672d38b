"""The API's constraints on a reply (docs/api.md, "Structured output"): OpenAI's `response_format` and vLLM's
`structured_outputs` {json, regex, choice, grammar, json_object}, each one grammar (webchat.grammar.build); built on a
compiler thread (webchat.grammar.compiler), never on the event loop.

    grammar = request_grammar(response_format, structured_outputs)   # None: free text; APIError 400 naming the field
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from webchat.grammar.bounds import GrammarError, GrammarLimit
from webchat.grammar.build import ANY_JSON_OBJECT, choice, lark, regex, validate
from webchat.serve.replyformat import ResponseFormat, format_grammar, schema_grammar
from webchat.serve.rules import RuleError

MAX_CHOICES = 1000
MAX_GRAMMAR_CHARS = 256 * 1024


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its `guided_*` fields before 0.12): exactly one of them."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)] | None \
        = None
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_object: bool | None = None

    def one_grammar(self, field: str) -> str:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if k == "json" else k) not in (None, False)]
        if len(given) != 1:
            raise RuleError(field, f"{field} takes exactly one of json, regex, choice, grammar, json_object; got "
                            f"{given or 'none'}")
        kind = given[0]
        at = f"{field}.{kind}"
        try:
            if kind == "json":
                schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
                if not isinstance(schema, dict | bool):
                    raise RuleError(at, f"{at} must be a JSON schema (an object), got {type(schema).__name__}")
                return schema_grammar(schema, at)
            if kind == "json_object":
                return ANY_JSON_OBJECT
            grammar = (regex(self.regex or "", at) if kind == "regex" else choice(self.choice or []) if kind == "choice"
                       else lark(self.grammar or "", at))
            validate(grammar)
            return grammar
        except (ValueError, RecursionError) as exc:  # GrammarError, a json_ string that is not JSON (or too deep)
            if isinstance(exc, RuleError):
                raise
            if isinstance(exc, GrammarLimit):  # names its place already
                raise RuleError(at, str(exc)) from None
            raise RuleError(at, f"{at}: {exc}") from None


def request_grammar(response_format: ResponseFormat | None, structured: StructuredOutputs | None) -> str | None:
    """The grammar a request asks for, from either field (both at once: 400), validated by llguidance."""
    if structured is not None and response_format is not None and response_format.type != "text":
        raise RuleError("structured_outputs", "give either response_format or structured_outputs, not both")
    if structured is not None:
        return structured.one_grammar("structured_outputs")
    return format_grammar(response_format, "response_format")


__all__ = ["GrammarError", "ResponseFormat", "StructuredOutputs", "request_grammar"]
