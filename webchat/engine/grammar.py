"""Grammars as constraints (webchat.engine.constraint) on llguidance: a JSON schema, a regex, a choice or a Lark grammar
compiled once per request into a matcher that advances with every emitted token.

    grammars = grammars_for(tokenizer, vocab)          # one LLTokenizer per loaded tokenizer and stop set (~0.3 s)
    grammar = json_schema(schema) | regex(r) | choice([...]) | lark(text) | ANY_JSON_OBJECT
    validate(grammar); grammars.check(grammar)         # GrammarError naming what the library refused
    constraint = grammars.constraint(grammar, stop_ids) # a Constraint: mask / forced / accept (+ replay)

llguidance (Rust, no Python dependencies) computes a mask in tens of microseconds on a 49k vocabulary, reports the
JSON Schema keywords it does not implement (so a request can name them), forces the tokens a grammar leaves no choice
about (`compute_ff_tokens`), and takes its stop tokens as the tokenizer's EOS set: a stop token is allowed exactly
where the grammar may end. The engine core never imports this module; transports build the constraint.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any, Protocol
from weakref import WeakKeyDictionary

import llguidance as llg
import torch

from webchat.engine.constraint import ConstraintError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON whitespace: at most this many characters at each place JSON allows it (a model stuck emitting newlines moves on)
WHITESPACE = r"[\x20\x0A]{0,16}"
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": WHITESPACE, "lenient": False}
SAFE_INTEGER = 2**53 - 1
ANY_JSON_OBJECT: str = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)


class GrammarError(ValueError):
    """llguidance refused a grammar: an unsupported JSON Schema keyword, an invalid regex, a Lark syntax error."""


class TokenizerSource(Protocol):
    """What a grammar needs of webchat.text.tokenizer.Tokenizer."""

    @property
    def stop_token_ids(self) -> list[int]: ...
    def to_json(self) -> str: ...


def interoperable(schema: Any) -> Any:
    """The schema with every integer that lacks a bound held within ±(2**53 - 1), the range in which JSON numbers are
    interoperable (RFC 7493, I-JSON): a sampled model otherwise may write digits until its token budget runs out (as
    llama-server's "age": 203844761322...). Bounds a schema gives are kept."""
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


def json_schema(schema: dict[str, Any] | bool) -> str:
    """A grammar for instances of `schema` (bounded whitespace, integers within I-JSON's range, unsupported keywords
    refused by validate())."""
    body: dict[str, Any] = {} if schema is True else {"not": {}} if schema is False else interoperable(schema)
    own = body.get("x-guidance")
    options: JsonCompileOptions = dict(JSON_OPTIONS)  # type: ignore[assignment]
    if isinstance(own, dict) and ("whitespace_flexible" in own or "whitespace_pattern" in own):
        del options["whitespace_pattern"]  # the schema's own `x-guidance` whitespace wins
    try:
        return llg.LLMatcher.grammar_from_json_schema(body, defaults=options)
    except ValueError as exc:
        raise GrammarError(f"the JSON schema could not be read: {exc}") from None


def regex(pattern: str) -> str:
    return llg.LLMatcher.grammar_from_regex(pattern)


def choice(options: list[str]) -> str:
    """Exactly one of the strings."""
    return lark("start: " + " | ".join(json.dumps(o) for o in options))


def lark(text: str) -> str:
    """A Lark grammar in llguidance's dialect (docs: llguidance's docs/syntax.md), special tokens as <name>."""
    return llg.LLMatcher.grammar_from_lark(text)


def validate(grammar: str) -> None:
    """GrammarError naming what llguidance refuses in a grammar (no tokenizer needed: sub-millisecond for a schema
    of a few kilobytes): `Unimplemented keys: ["if"]`, a regex with a look-ahead, a Lark syntax error."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar is not valid")


class Grammars:
    """Compiles grammars for one tokenizer: an LLTokenizer per stop-token set (the grammar's end), built once."""

    def __init__(self, source: TokenizerSource, vocab_size: int) -> None:
        self.source, self.vocab_size = source, vocab_size
        self._json = source.to_json()
        self._tokenizers: dict[tuple[int, ...], llg.LLTokenizer] = {}
        self._lock = threading.Lock()

    def tokenizer(self, stop_ids: list[int] | None = None) -> llg.LLTokenizer:
        """The LLTokenizer whose EOS tokens are stop_ids (default: the tokenizer's stop tokens); ~0.3 s the first
        time for a 49k vocabulary: call it off the event loop."""
        key = tuple(self.source.stop_token_ids if stop_ids is None else stop_ids)
        with self._lock:
            if key not in self._tokenizers:
                self._tokenizers[key] = llg.LLTokenizer(self._json, n_vocab=self.vocab_size, eos_token=list(key))
            return self._tokenizers[key]

    def check(self, grammar: str) -> None:
        """GrammarError naming the problem (llguidance's message: `Unimplemented keys: ["if"]`, a regex error...)."""
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if is_error:
            raise GrammarError(messages[0] if messages else "the grammar is not valid")

    def constraint(self, grammar: str, stop_ids: list[int] | None = None) -> GrammarConstraint:
        """A fresh matcher for one request (building it drops the GIL: milliseconds, more for a large schema)."""
        matcher = llg.LLMatcher(self.tokenizer(stop_ids), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarConstraint(matcher, grammar)


_CACHE: WeakKeyDictionary[object, Grammars] = WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def grammars_for(source: TokenizerSource, vocab_size: int) -> Grammars:
    """The Grammars of a loaded tokenizer (kept while the tokenizer lives)."""
    with _CACHE_LOCK:
        found = _CACHE.get(source)
        if found is None or found.vocab_size != vocab_size:
            found = _CACHE[source] = Grammars(source, vocab_size)
        return found


class GrammarConstraint:
    """webchat.engine.constraint.Constraint on an llguidance matcher: the mask written straight into the engine's
    int32 bitmask (bit t: word t // 32, bit t % 32, llguidance's own layout)."""

    def __init__(self, matcher: llg.LLMatcher, grammar: str) -> None:
        self.matcher, self.grammar = matcher, grammar
        self.accepted = 0  # tokens consumed (a replayed prefix included)

    def mask(self, bits: torch.Tensor) -> bool:
        if bits.dtype != torch.int32 or not bits.is_contiguous() or bits.device.type != "cpu":
            raise ValueError(f"the mask must be a contiguous CPU int32 tensor, got {bits.dtype} on {bits.device}")
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        self._raise_if_error()
        return True

    def forced(self) -> list[int]:
        return [] if self.matcher.is_error() else list(self.matcher.compute_ff_tokens())

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.accepted += 1

    def replay(self, tokens: list[int]) -> None:
        """Consume the tokens a branch or Continue keeps (their bytes must follow the grammar), as if emitted."""
        for i, token in enumerate(tokens):
            if not self.matcher.consume_token(token):
                raise ConstraintError(f"token {i} of the kept reply ({token}) does not follow the reply's format: "
                                      f"{self.matcher.get_error()}")
            self.accepted += 1

    def is_accepting(self) -> bool:
        """Whether the reply so far is a whole instance of the grammar."""
        return self.matcher.is_accepting()

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar cannot go on: {self.matcher.get_error()}")
