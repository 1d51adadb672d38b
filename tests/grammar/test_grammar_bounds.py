"""Issue 63, rows 1-4 and 10-13 below the server: a grammar's shape bounded before llguidance sees it
(webchat.grammar.bounds), compiled on a thread whose stack holds what an 8 MiB one cannot (webchat.grammar.compiler),
and its first steps tried at build (webchat.grammar.matcher)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import llguidance as llg
import pytest
from grammars import alias_chain, defs_chain, lark_chain, nested  # tests/ is on sys.path under pytest

from webchat.grammar import build
from webchat.grammar.bounds import (
    MAX_CHAIN,
    MAX_NESTING,
    MAX_REPEAT,
    GrammarError,
    GrammarLimit,
    check_lark,
    check_regex,
    check_schema,
    regex_shape,
)
from webchat.grammar.compiler import Compiler
from webchat.grammar.matcher import grammars_for
from webchat.text.tokenizer import Tokenizer


# ---------------------------------------------------------------- the bounds
@pytest.mark.parametrize(("schema", "says"), [
    (defs_chain(2000), "a chain of 4003 subschemas"),
    (alias_chain(5000), "subschemas"),
    ({"$defs": {f"d{i}": {"anyOf": [{"type": "null"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(3000)}
      | {"d3000": {"type": "string"}}, "$ref": "#/$defs/d0"}, "subschemas"),
    (nested(900), f"nests {MAX_NESTING + 1} or more levels deep"),
    ({"$ref": "#"}, "the $refs # -> # form a cycle that never reaches a value"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
     "#/$defs/a -> #/$defs/b -> #/$defs/b/anyOf/0 -> #/$defs/a form a cycle"),
    ({"type": "string", "pattern": "(a{1000}){1000}"}, "repeats a piece 1000000 times"),
])
def test_a_schema_past_a_bound_is_refused_by_name(schema: dict[str, Any], says: str) -> None:
    with pytest.raises(GrammarLimit, match="^where[ :]") as err:
        check_schema(schema, "where")
    assert says in str(err.value)


def test_real_schemas_pass_the_bounds_recursive_ones_included() -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": r"^\d{4}-\d{2}$"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    check_schema(tree, "tree")  # recursion through properties and items reaches values: no cycle
    check_schema(defs_chain(MAX_CHAIN // 2 - 2), "chain")
    check_schema(nested(MAX_NESTING - 1), "nested")  # a chain of subschemas past MAX_CHAIN is its own bound
    person = {"type": "object", "properties": {"age": {"type": "integer"}, "tags": {"type": "array", "items": {
        "enum": [{"deep": [[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]}]}}}}  # enum values are data, not subschemas
    check_schema(person, "person")


def test_the_lark_bounds_follow_rules_and_inline_schemas() -> None:
    with pytest.raises(GrammarLimit, match="a chain of 3002 rules, each referring to the next"):
        check_lark(lark_chain(3000), "g")
    check_lark(lark_chain(MAX_CHAIN - 3), "g")
    with pytest.raises(GrammarLimit, match=r"%json at character \d+\): a chain of"):
        check_lark('start: "x" obj\nobj: %json ' + json.dumps(defs_chain(1000)), "g")
    with pytest.raises(GrammarLimit, match="brackets nest"):
        check_lark("start: " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1), "g")
    with pytest.raises(GrammarLimit, match="repeats a piece"):
        check_lark("start: /a{100000}/", "g")
    # a real grammar of the tools' kind: a lazy rule, a regex with / inside a class, an inline schema, a comment
    check_lark('%llguidance {}\nstart: TEXT | seg  // text or a call\nseg[lazy]: TEXT "<tool>" /[ \\t\\/]{0,4}/ call\n'
               'TEXT: /(.|\\n)*/ & ~/(?s:.*)<tool>(?s:.*)/\ncall: %json {"type": "object"}\n', "g")


@pytest.mark.parametrize(("pattern", "shape"), [
    ("a{1000000}", (0, 1_000_000)), ("(a{1000}){1000}", (1, 1_000_000)), (".*a.{40}", (0, 40)),
    (r"\d{4}-\d{2}", (0, 4)), ("[a-z]{1,10000}", (0, 10_000)), ("((a)){3}{4}", (2, 12)), (r"\p{L}{5}", (0, 5)),
    ("[]a]{20}", (0, 20)), ("x|y{30000}", (0, 30_000)), ("(" * 150 + "a" + ")" * 150, (150, 1)),
])
def test_the_regex_shape_counts_nesting_and_repetition(pattern: str, shape: tuple[int, int]) -> None:
    assert regex_shape(pattern) == shape


def test_a_regex_past_the_bounds_is_refused() -> None:
    with pytest.raises(GrammarLimit, match=f"at most {MAX_REPEAT} are allowed"):
        check_regex("a{1000000}", "r")
    with pytest.raises(GrammarLimit, match="nests groups 150 deep"):
        check_regex("(" * 150 + "a" + ")" * 150, "r")
    check_regex("a{10000}", "r")


# ---------------------------------------------------------------- the compiler threads
def test_the_compiler_thread_survives_a_chain_that_kills_an_8_mib_stack() -> None:
    """The library alone, no bounds: a 3,000-rule chain is validated on a compiler thread (256 MiB) where an 8 MiB
    thread dies (measured: 2,000 pass there, 4,000 crash the process)."""
    grammar = llg.LLMatcher.grammar_from_lark(lark_chain(6000))
    is_error, _ = Compiler(threads=1).run_sync(llg.LLMatcher.validate_grammar_with_warnings, grammar)
    assert is_error is False


def test_a_compile_past_its_deadline_is_a_grammar_error_naming_it() -> None:
    release = threading.Event()
    compiler = Compiler(threads=1, deadline=0.2)
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match="took more than 0.2 s"):
        asyncio.run(compiler.run(release.wait, 30))
    assert time.monotonic() - t0 < 5
    release.set()


# ---------------------------------------------------------------- a matcher's first steps
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.mark.parametrize(("grammar", "says"), [
    (lambda: build.lark("start: " + " | ".join(f'"w{i}"' for i in range(10000))), "Current row has 10001 items"),
    (lambda: build.json_schema({"anyOf": [{"type": "string", "pattern": "ab"}, {"$ref": "#"}]}),
     "cycle that never reaches a value"),
])
def test_a_grammar_that_fails_early_is_refused_at_build(tokenizer: Tokenizer, grammar: Any, says: str) -> None:
    """Rows 11 and 13: on main these passed validation and failed mid-reply (a 500)."""
    with pytest.raises(GrammarError, match=says):
        grammars_for(tokenizer, 512).constraint(grammar())
