"""Grammars as constraints (webchat.engine.constraint) on llguidance: a grammar text (webchat.grammar.build) compiled
once per request into a matcher that advances with every emitted token, within a CPU-time budget per call.

    grammars = grammars_for(tokenizer, vocab)          # one LLTokenizer per loaded tokenizer and stop set (~0.3 s)
    constraint = grammars.constraint(grammar)          # built, then its first steps tried: GrammarError if they fail
    constraint.mask(bits) / forced() / accept(token)   # ConstraintError naming it when the grammar cannot go on

llguidance computes a mask in tens of microseconds on a 49k vocabulary, forces the tokens a grammar leaves no choice
about (`compute_ff_tokens`), and takes its stop tokens as the tokenizer's EOS set: a stop token is allowed exactly
where the grammar may end. Its parser and lexer have fuel per step (webchat.grammar.build.LIMITS); on top, each call
into the matcher has a CPU-time budget (MASK_BUDGET_S): a grammar that needs more ends its own request with a named
error on the call that overran (the engine fails that sequence alone), so it never holds the step of everyone else
for longer than one budget. The engine core never imports this module; front ends build the constraint.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol
from weakref import WeakKeyDictionary

import llguidance as llg
import torch

from webchat.engine.constraint import ConstraintError
from webchat.grammar.bounds import GrammarError
from webchat.grammar.build import LIMITS

MASK_BUDGET_S = 0.05  # CPU time one call into a matcher may take on the device thread (a typical mask: 40 µs)
PROBE_STEPS = 3  # steps tried at build time along the first allowed token (finds a lexer or parser that fails early)


class TokenizerSource(Protocol):
    """What a grammar needs of webchat.text.tokenizer.Tokenizer."""

    @property
    def stop_token_ids(self) -> list[int]: ...
    def to_json(self) -> str: ...


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
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer(), limits=LIMITS)
        if is_error:
            raise GrammarError(messages[0] if messages else "the grammar is not valid")

    def constraint(self, grammar: str, stop_ids: list[int] | None = None) -> GrammarConstraint:
        """A fresh matcher for one request (building it drops the GIL: milliseconds, more for a large schema), its
        first steps tried on a copy: a grammar whose lexer or parser fails there (`a{1000000}`: "too many expressions";
        10,000 alternatives in one rule: "Current row has 10001 items") is a GrammarError now, not mid-reply."""
        matcher = llg.LLMatcher(self.tokenizer(stop_ids), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        _probe(matcher.deep_copy(), self.vocab_size, set(self.source.stop_token_ids if stop_ids is None else stop_ids))
        return GrammarConstraint(matcher, grammar)


def _probe(matcher: llg.LLMatcher, vocab_size: int, stops: set[int]) -> None:
    """Take PROBE_STEPS steps along the first token each mask allows (a stop token only where nothing else is)."""
    bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    for _ in range(PROBE_STEPS):
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        if matcher.is_error():
            raise GrammarError(f"the grammar fails at its first step: {_first_line(matcher.get_error())}")
        allowed = _allowed_ids(bits, vocab_size)
        token = next((t for t in allowed if t not in stops), None)
        if token is None:
            return  # only a stop token may come: the grammar is complete
        if not matcher.consume_token(token):
            raise GrammarError(f"the grammar fails within its first {PROBE_STEPS} tokens: "
                               f"{_first_line(matcher.get_error())}")


def _allowed_ids(bits: torch.Tensor, vocab_size: int) -> list[int]:
    """The first few ids a mask allows, in order (enough to find one that is not a stop token)."""
    words = bits.tolist()
    out: list[int] = []
    for w, word in enumerate(words):
        if word:
            u = word & 0xFFFFFFFF
            out.extend(w * 32 + b for b in range(32) if u >> b & 1 and w * 32 + b < vocab_size)
            if len(out) >= 8:
                break
    return out


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "the grammar cannot go on"


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
    int32 bitmask (bit t: word t // 32, bit t % 32, llguidance's own layout); every call within MASK_BUDGET_S of
    CPU time (thread time: a busy machine's waits do not count against the grammar)."""

    def __init__(self, matcher: llg.LLMatcher, grammar: str, budget_s: float | None = None) -> None:
        self.matcher, self.grammar = matcher, grammar
        self.budget_s = MASK_BUDGET_S if budget_s is None else budget_s
        self.accepted = 0  # tokens consumed (a replayed prefix included)

    def mask(self, bits: torch.Tensor) -> bool:
        if bits.dtype != torch.int32 or not bits.is_contiguous() or bits.device.type != "cpu":
            raise ValueError(f"the mask must be a contiguous CPU int32 tensor, got {bits.dtype} on {bits.device}")
        t0 = time.thread_time()
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        self._within_budget(t0, "computing the tokens allowed next")
        self._raise_if_error()
        return True

    def forced(self) -> list[int]:
        t0 = time.thread_time()
        out = [] if self.matcher.is_error() else list(self.matcher.compute_ff_tokens())
        self._within_budget(t0, "finding the tokens the grammar forces")
        return out

    def accept(self, token: int) -> None:
        t0 = time.thread_time()
        ok = self.matcher.consume_token(token)
        self._within_budget(t0, "advancing the grammar")
        if not ok:
            raise ConstraintError(f"the grammar refused token {token}: {_first_line(self.matcher.get_error())}")
        self.accepted += 1

    def replay(self, tokens: list[int]) -> None:
        """Consume the tokens a branch or Continue keeps (their bytes must follow the grammar), as if emitted."""
        for i, token in enumerate(tokens):
            if not self.matcher.consume_token(token):
                raise ConstraintError(f"token {i} of the kept reply ({token}) does not follow the reply's format: "
                                      f"{_first_line(self.matcher.get_error())}")
            self.accepted += 1

    def is_accepting(self) -> bool:
        """Whether the reply so far is a whole instance of the grammar."""
        return self.matcher.is_accepting()

    def _within_budget(self, t0: float, what: str) -> None:
        spent = time.thread_time() - t0
        if spent > self.budget_s:
            raise ConstraintError(f"the grammar is too slow: {what} took {spent * 1000:.0f} ms of CPU time, over the "
                                  f"{self.budget_s * 1000:.0f} ms one step allows")

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar cannot go on: {_first_line(self.matcher.get_error())}")
