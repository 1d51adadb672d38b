"""Grammar texts for llguidance from what a request asks: a JSON schema, a regex, a choice, a Lark grammar; each
bounded first (webchat.grammar.bounds), then validated by the library without a tokenizer.

    grammar = json_schema(schema) | regex(r) | choice([...]) | lark(text) | ANY_JSON_OBJECT
    validate(grammar)        # GrammarError naming what the library refuses

Call these off the event loop (webchat.grammar.compiler): a schema of a few hundred kilobytes takes the library a
good part of a second.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance as llg

from webchat.grammar.bounds import GrammarError, check_lark, check_regex, check_schema

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON whitespace: at most this many characters at each place JSON allows it (a model stuck emitting newlines moves on)
WHITESPACE = r"[\x20\x0A]{0,16}"
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": WHITESPACE, "lenient": False}
SAFE_INTEGER = 2**53 - 1
ANY_JSON_OBJECT: str = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
# the library's own bounds on one grammar: each parse or lexer step has fuel, so no mask runs away (its defaults
# allow a step ~15 ms of lexer work and an initial lexer of ~20 ms; these halve both, far above a real schema's needs)
LIMITS = llg.LLParserLimits(step_lexer_fuel=100_000, initial_lexer_fuel=500_000, step_max_items=25_000,
                            max_lexer_states=100_000)


def interoperable(schema: Any) -> Any:
    """The schema with every integer that lacks a bound held within ±(2**53 - 1), the range in which JSON numbers are
    interoperable (RFC 7493, I-JSON): a sampled model otherwise may write digits until its token budget runs out (as
    llama-server's "age": 203844761322...). Bounds a schema gives are kept. (Recursive: bounded schemas only.)"""
    if isinstance(schema, list):
        return [interoperable(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("const", "enum", "default", "examples") else interoperable(v) for k, v in schema.items()}
    kind = out.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind and "number" not in kind):
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
    return out


def json_schema(schema: dict[str, Any] | bool, where: str = "the schema") -> str:
    """A grammar for instances of `schema` (bounded whitespace, integers within I-JSON's range, unsupported keywords
    refused by validate())."""
    check_schema(schema, where)
    body: dict[str, Any] = {} if schema is True else {"not": {}} if schema is False else interoperable(schema)
    own = body.get("x-guidance")
    options: JsonCompileOptions = dict(JSON_OPTIONS)  # type: ignore[assignment]
    if isinstance(own, dict) and ("whitespace_flexible" in own or "whitespace_pattern" in own):
        del options["whitespace_pattern"]  # the schema's own `x-guidance` whitespace wins
    try:
        return llg.LLMatcher.grammar_from_json_schema(body, defaults=options)
    except ValueError as exc:
        raise GrammarError(f"the JSON schema could not be read: {exc}") from None


def regex(pattern: str, where: str = "the regex") -> str:
    check_regex(pattern, where)
    return llg.LLMatcher.grammar_from_regex(pattern)


def choice(options: list[str]) -> str:
    """Exactly one of the strings."""
    return lark("start: " + " | ".join(json.dumps(o) for o in options))


def lark(text: str, where: str = "the grammar") -> str:
    """A Lark grammar in llguidance's dialect (docs: llguidance's docs/syntax.md), special tokens as <name>."""
    check_lark(text, where)
    return llg.LLMatcher.grammar_from_lark(text)


def validate(grammar: str) -> None:
    """GrammarError naming what llguidance refuses in a grammar (no tokenizer needed): `Unimplemented keys:
    ["if"]`, a regex with a look-ahead, a Lark syntax error, a grammar past the library's size limits."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar is not valid")
