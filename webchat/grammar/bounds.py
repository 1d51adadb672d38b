"""The shape of a grammar, bounded before the grammar library sees it: nesting, chains of `$ref`s and rules, cycles
that never reach a value, counted repetition. Each walk is iterative, so no input can exhaust a stack here.

    check_schema(schema, "response_format.json_schema.schema")   # GrammarLimit naming the limit and the place
    check_lark(text, "structured_outputs.grammar")
    check_regex(pattern, "structured_outputs.regex")

llguidance compiles a grammar by recursion: a chain of 2,000 `$defs` (each an array of the next) or of 3,000 Lark
rules overflows an 8 MiB thread stack and kills the process. These bounds keep every grammar far from that (the
compiler threads also run on a 256 MiB stack, webchat.grammar.compiler), and answer with a message a client can act
on instead of a crash.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

MAX_NESTING = 256  # JSON objects and arrays inside one another in a schema (an object's property: 2 levels)
MAX_CHAIN = 256  # the longest chain of subschemas through nesting and `$ref`s, or of Lark rules through references
MAX_REGEX_NESTING = 100  # groups inside groups
MAX_REPEAT = 10_000  # the largest product of counted repetitions along one nesting path (`(a{100}){100}`)

ALIAS_KEYS = ("allOf", "anyOf", "oneOf")  # a subschema that is one of these (or a $ref) consumes nothing first


class GrammarError(ValueError):
    """A grammar that cannot be used: llguidance refused it (an unsupported JSON Schema keyword, an invalid regex, a
    Lark syntax error), it is past a bound, or it failed its first steps."""


class GrammarLimit(GrammarError):
    """A grammar past a bound: the message names the bound, the value found, and where."""


# ---------------------------------------------------------------- JSON schemas
def check_schema(schema: Any, where: str) -> None:
    """GrammarLimit when the schema nests past MAX_NESTING, a chain of subschemas (through `$ref`s) runs past
    MAX_CHAIN, `$ref`s form a cycle that never reaches a value (`{"$ref": "#"}`), or a `pattern` is past the regex
    bounds."""
    nodes = _schema_nodes(schema, where)
    edges: dict[int, list[int]] = {id(n): [] for n, _ in nodes}
    aliases: dict[int, list[int]] = {id(n): [] for n, _ in nodes}
    names = {id(n): p for n, p in nodes}
    for node, pointer in nodes:
        for child in _children(node):
            edges[id(node)].append(id(child))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = _resolve(schema, ref)
            if target is None:
                continue  # a missing target is the library's error to name
            edges[id(node)].append(id(target))
            aliases[id(node)].append(id(target))
        for key in ALIAS_KEYS:
            members = node.get(key)
            if isinstance(members, list):
                aliases[id(node)].extend(id(m) for m in members if isinstance(m, dict))
        for key in ("pattern",):
            if isinstance(node.get(key), str):
                check_regex(node[key], f"{where} ({pointer}/{key})")
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in props:
                check_regex(key, f"{where} ({pointer}/patternProperties)")
    cycle = _cycle(aliases)
    if cycle:
        path = " -> ".join(names[n] for n in cycle)
        raise GrammarLimit(f"{where}: the $refs {path} form a cycle that never reaches a value; a recursive schema "
                           "must go through an object's properties or an array's items")
    depth, chain = _longest_chain(edges)
    if depth > MAX_CHAIN:
        raise GrammarLimit(f"{where}: a chain of {depth} subschemas (through nesting and $refs, from {names[chain[0]]} "
                           f"to {names[chain[-1]]}); at most {MAX_CHAIN} are allowed")


def _schema_nodes(schema: Any, where: str) -> list[tuple[dict[str, Any], str]]:
    """Every JSON object in the schema with its JSON pointer, nesting checked (iteratively)."""
    out: list[tuple[dict[str, Any], str]] = []
    stack: list[tuple[Any, str, int]] = [(schema, "#", 1)]
    while stack:
        value, pointer, depth = stack.pop()
        if depth > MAX_NESTING and isinstance(value, dict | list):
            raise GrammarLimit(f"{where}: the schema nests {MAX_NESTING + 1} or more levels deep (at {pointer[:120]}); "
                               f"at most {MAX_NESTING} are allowed")
        if isinstance(value, dict):
            out.append((value, pointer))
            stack.extend((v, f"{pointer}/{_escape(str(k))}", depth + 1) for k, v in value.items()
                         if k not in ("const", "enum", "default", "examples"))
        elif isinstance(value, list):
            stack.extend((v, f"{pointer}/{i}", depth + 1) for i, v in enumerate(value))
    return out


def _children(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The JSON objects directly under a node (through one list level), values of enum/const excluded."""
    for key, value in node.items():
        if key in ("const", "enum", "default", "examples"):
            continue
        if isinstance(value, dict):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, dict))


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _resolve(root: Any, ref: str) -> dict[str, Any] | None:
    """A local JSON pointer (`#/$defs/a`) in the schema; None when it names nothing."""
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node if isinstance(node, dict) else None


# ---------------------------------------------------------------- graphs
def _cycle(graph: dict[int, list[int]]) -> list[int]:
    """One cycle of the graph as a path that starts and ends at the same node; [] when it has none (iterative DFS)."""
    state: dict[int, int] = {}  # 1: on the stack, 2: done
    for root in graph:
        if root in state:
            continue
        stack: list[tuple[int, int]] = [(root, 0)]
        path: list[int] = []
        while stack:
            node, i = stack.pop()
            if i == 0:
                state[node] = 1
                path.append(node)
            succ = graph.get(node, [])
            if i < len(succ):
                stack.append((node, i + 1))
                nxt = succ[i]
                if state.get(nxt) == 1:
                    return path[path.index(nxt):] + [nxt]
                if nxt not in state:
                    stack.append((nxt, 0))
            else:
                state[node] = 2
                path.pop()
    return []


def _longest_chain(graph: dict[int, list[int]]) -> tuple[int, list[int]]:
    """The most nodes on one path, edges back to a node on the current path left out (recursion is not a chain),
    and that path (iterative post-order)."""
    best: dict[int, int] = {}
    nxt: dict[int, int | None] = {}
    on_path: set[int] = set()
    for root in graph:
        if root in best:
            continue
        stack: list[tuple[int, int]] = [(root, 0)]
        on_path.add(root)
        while stack:
            node, i = stack.pop()
            succ = graph.get(node, [])
            if i < len(succ):
                stack.append((node, i + 1))
                child = succ[i]
                if child not in best and child not in on_path:
                    on_path.add(child)
                    stack.append((child, 0))
                continue
            on_path.discard(node)
            done = [c for c in succ if c in best]
            pick = max(done, key=lambda c: best[c], default=None)
            best[node] = 1 + (best[pick] if pick is not None else 0)
            nxt[node] = pick
    if not best:
        return 0, []
    start = max(best, key=lambda n: best[n])
    chain: list[int] = []
    at: int | None = start
    while at is not None and len(chain) <= best[start]:
        chain.append(at)
        at = nxt.get(at)
    return best[start], chain


# ---------------------------------------------------------------- regular expressions
def check_regex(pattern: str, where: str) -> None:
    """GrammarLimit when groups nest past MAX_REGEX_NESTING or counted repetitions multiply past MAX_REPEAT along
    one nesting path (`a{1000000}`, `(a{1000}){1000}`: the library builds that many expressions)."""
    nesting, repeat = regex_shape(pattern)
    if nesting > MAX_REGEX_NESTING:
        raise GrammarLimit(f"{where}: the regex nests groups {nesting} deep; at most {MAX_REGEX_NESTING} are allowed")
    if repeat > MAX_REPEAT:
        raise GrammarLimit(f"{where}: the regex repeats a piece {repeat} times (counted repetitions multiplied along "
                           f"one path); at most {MAX_REPEAT} are allowed")


_COUNT = re.compile(r"\{(\d{1,9})(,(\d{0,9}))?\}")


def regex_shape(pattern: str) -> tuple[int, int]:
    """(deepest group nesting, largest product of counted repetitions along one nesting path) of a regex in the
    syntax of Rust's regex crate (llguidance's)."""
    frames: list[int] = [1]  # per open group: the largest weight of a piece inside it
    last = 0  # the weight of the piece just closed (0: none, a quantifier has nothing to repeat)
    deepest, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            if i < n + 1 and pattern[i - 1:i] in ("p", "P", "x", "u", "U") and pattern[i:i + 1] == "{":
                close = pattern.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
        elif c == "[":
            i = _class_end(pattern, i)
            last = 1
        elif c == "(":
            frames.append(1)
            deepest = max(deepest, len(frames) - 1)
            last = 0
            i += 1
        elif c == ")":
            last = frames.pop() if len(frames) > 1 else 1
            i += 1
        elif c == "{" and (m := _COUNT.match(pattern, i)) and last:
            low, high = int(m.group(1)), m.group(3)
            last *= max(low, int(high)) if high else low
            i = m.end()
        elif c in "*+?|":
            i += 1
            if c == "|":
                last = 0
        else:
            last = 1
            i += 1
        if last:
            frames[-1] = max(frames[-1], min(last, MAX_REPEAT * MAX_REPEAT))
    return deepest, max(frames)


def _class_end(pattern: str, i: int) -> int:
    """The index past the character class opening at i (nested classes, escapes, a leading `]` or `^]`)."""
    depth, i = 0, i
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            if pattern[i:i + 1] == "^":
                i += 1
            if pattern[i:i + 1] == "]":
                i += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


# ---------------------------------------------------------------- Lark grammars (llguidance's dialect)
_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r]+) | (?P<nl>\n) | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?!/)(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><\[[^\]\n]*\]>|<[^<>\s]{1,200}>)
  | (?P<directive>%[a-z_]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
_OPEN, _CLOSE = "([{", ")]}"


def check_lark(text: str, where: str) -> None:
    """GrammarLimit when a chain of rules (each referring to the next) runs past MAX_CHAIN, brackets nest past
    MAX_NESTING, or an inline `%json` schema or a `/regex/` is past its bounds."""
    tokens = _lark_tokens(text, where)
    rules: dict[str, set[str]] = {}
    current: str | None = None
    depth, i = 0, 0
    while i < len(tokens):
        kind, value, line_start = tokens[i]
        defined = _definition(tokens, i) if line_start else None
        if defined is not None:
            current, i, depth = tokens[i + (tokens[i][1] in "?!")][1], defined, 0
            rules.setdefault(current, set())
            continue
        if kind == "name" and current is not None:
            rules[current].add(value)
        elif kind == "other" and value in _OPEN:
            depth += 1
            if depth > MAX_NESTING:
                raise GrammarLimit(f"{where}: brackets nest {depth} deep in rule {current!r}; at most {MAX_NESTING} "
                                   "are allowed")
        elif kind == "other" and value in _CLOSE:
            depth = max(0, depth - 1)
        i += 1
    ids = {name: k for k, name in enumerate(rules)}
    graph = {ids[name]: [ids[r] for r in sorted(refs) if r in ids and r != name] for name, refs in rules.items()}
    length, chain = _longest_chain(graph)
    if length > MAX_CHAIN:
        names = list(rules)
        raise GrammarLimit(f"{where}: a chain of {length} rules, each referring to the next (from {names[chain[0]]!r} "
                           f"to {names[chain[-1]]!r}); at most {MAX_CHAIN} are allowed")


def _lark_tokens(text: str, where: str) -> list[tuple[str, str, bool]]:
    """(kind, text, first on its line) of each token; a directive's JSON object (`%json {...}`, `%llguidance {}`) is
    read as JSON (a `%json` schema checked), a `/regex/` checked."""
    out: list[tuple[str, str, bool]] = []
    pos, line_start = 0, True
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m is not None  # `other` matches any character
        kind, value = m.lastgroup or "other", m.group()
        pos = m.end()
        if kind in ("ws", "comment"):
            continue
        if kind == "nl":
            line_start = True
            continue
        if kind == "directive" and text.startswith("{", at := _skip_ws(text, pos)):
            try:
                obj, pos = json.JSONDecoder().raw_decode(text, at)
            except (ValueError, RecursionError):
                pass  # not JSON: the library names it
            else:
                if value == "%json":
                    check_schema(obj, f"{where} (%json at character {at})")
        elif kind == "regex":
            check_regex(value[1:value.rindex("/")], f"{where} ({value[:40]})")
        out.append((kind, value, line_start))
        line_start = False
    return out


def _definition(tokens: list[tuple[str, str, bool]], i: int) -> int | None:
    """Where the body of a rule defined at token i starts (`name:`, `?name:`, `name[lazy]:`, `NAME.2:`), else None."""
    if tokens[i][1] in "?!":
        i += 1
    if i >= len(tokens) or tokens[i][0] != "name":
        return None
    i += 1
    while i < len(tokens) and not tokens[i][2]:
        kind, value, _ = tokens[i]
        if kind == "other" and value == ":":
            return i + 1
        if not (kind == "name" or value in "[],." or value.isdigit()):
            return None
        i += 1
    return None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
