"""Suffix matching over token streams: what followed the context's best matches, and how many matches agree.

SuffixDecoding (Oliaro et al., 2024; Snowflake's Arctic Inference, which vLLM's `suffix` speculative method runs)
keeps suffix trees over the request's prompt and over earlier responses, matches the context's recent tokens in them
and drafts the continuation most occurrences share, each token scored by the share of occurrences that still agree
(a child's count over its parent's) and the draft capped by the match length. This index keeps the same facts in a
form cheap to grow from Python: every bigram's occurrences (stream, the position after it), newest last. A query
takes the context's last bigram, extends each of its recent occurrences' matches backwards against the context, and
follows the occurrences forward from two groups: those with the longest match (the context's own place, when a text
is being copied) and all of them (the common continuation).

    index = SuffixIndex(max_tokens=1 << 16)   # 0: unbounded (one sequence's own prompt and output)
    index.add(doc, tokens)                     # tokens: an append-only list the index keeps and reads as it grows
    index.paths(context, limit, exclude=doc)   # up to two Paths, longest match first

`new_index(max_tokens, native)` gives the same index in C++ where the model's backend installed it (a CPU model's
`suffix_index`: kernels/cpu/csrc/qsuffix.cpp, the same paths share for share), this class elsewhere; the C++ one
copies a doc's tokens in at each add.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

POSITION_BITS = 32
POSITION_MASK = (1 << POSITION_BITS) - 1
MAX_OCCURRENCES = 16  # a bigram's most recent occurrences examined by a query
MAX_MATCH = 64  # a match is extended backwards this far at most
MIN_SHARE = 0.1  # a path ends where fewer of its occurrences agree (Arctic's min_token_prob)
SPEC_OFFSET = 4  # a path drafts at most its match length + this (Arctic's max_spec_factor 1, plus an offset)


@dataclass
class Path:
    """A continuation: `match` context tokens matched; shares[i]: the share of the matched occurrences that continue
    with tokens[: i + 1] (non-increasing, 1.0 while they all agree)."""

    match: int
    tokens: list[int] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    pos: int = -1  # where tokens begin in the newest occurrence's doc


class Index(Protocol):
    """What the planner asks of an index (SuffixIndex, or the C++ one new_index() makes)."""

    def new_doc(self) -> int: ...

    def add(self, doc: int, tokens: list[int]) -> None: ...

    def paths(self, context: list[int], limit: int, exclude: int | None = None) -> list[Path]: ...


def new_index(max_tokens: int = 0, native: Callable[..., Any] | None = None) -> Index:
    """A SuffixIndex, or `native` made with this module's constants and Path (the C++ class a CPU model's backend
    installs as `suffix_index`: a lookup in 2-6 us instead of 9-13)."""
    if native is None:
        return SuffixIndex(max_tokens)
    return native(max_tokens, MAX_OCCURRENCES, MAX_MATCH, MIN_SHARE, SPEC_OFFSET, Path)  # type: ignore[no-any-return]


class SuffixIndex:
    """Bigram occurrences of several token streams (docs), the oldest docs dropped past max_tokens."""

    def __init__(self, max_tokens: int = 0) -> None:
        self.max_tokens = max_tokens
        self.docs: OrderedDict[int, list[int]] = OrderedDict()  # doc -> its tokens (the caller's list), oldest first
        self.done: dict[int, int] = {}  # doc -> tokens indexed so far
        self.where: dict[int, list[int]] = {}  # bigram (a << 32 | b) -> [doc << 32 | position after it], oldest first
        self.size = 0  # tokens indexed in the docs kept
        self.dead = 0  # occurrences left in `where` by dropped docs (compacted when they outnumber the live ones)
        self._next = 0

    def new_doc(self) -> int:
        """An id no doc has had (ids are never reused, so a dropped doc's stale occurrences find nothing)."""
        self._next += 1
        return self._next

    def add(self, doc: int, tokens: list[int]) -> None:
        """Index tokens' bigrams not indexed yet; `tokens` is kept and must only grow."""
        if doc not in self.docs:
            self.docs[doc], self.done[doc] = tokens, 0
        start, end = max(self.done[doc], 2), len(tokens)
        where, high = self.where, doc << POSITION_BITS
        for j in range(start, end):  # the bigram ending at j - 1, continued at j
            key = tokens[j - 2] << POSITION_BITS | tokens[j - 1]
            found = where.get(key)
            if found is None:
                where[key] = [high | j]
            else:
                found.append(high | j)
        self.size += max(0, end - self.done[doc])
        self.done[doc] = end
        if self.max_tokens:
            self._bound()

    def _bound(self) -> None:
        while self.size > self.max_tokens and len(self.docs) > 1:
            doc, tokens = self.docs.popitem(last=False)
            n = self.done.pop(doc)
            self.size -= n
            self.dead += n
        if self.dead > self.size:
            self._compact()

    def _compact(self) -> None:
        """Drop the occurrences of dropped docs."""
        live = set(self.docs)
        self.where = {key: kept for key, codes in self.where.items()
                      if (kept := [c for c in codes if c >> POSITION_BITS in live])}
        self.dead = 0

    def paths(self, context: list[int], limit: int, exclude: int | None = None) -> list[Path]:
        """Continuations of context (longest match first; at most two), each at most `limit` tokens and at most its
        match + SPEC_OFFSET; docs == exclude are not looked at."""
        n = len(context)
        if n < 2 or limit < 1:
            return []
        codes = self.where.get(context[-2] << POSITION_BITS | context[-1])
        if not codes:
            return []
        found: list[tuple[int, list[int], int]] = []  # (match, doc tokens, position after the match), newest first
        for code in reversed(codes[-MAX_OCCURRENCES:]):
            doc, pos = code >> POSITION_BITS, code & POSITION_MASK
            tokens = self.docs.get(doc)
            if doc == exclude or tokens is None or pos >= len(tokens):
                continue
            m, top = 2, min(MAX_MATCH, pos, n)
            while m < top and tokens[pos - 1 - m] == context[n - 1 - m]:
                m += 1
            found.append((m, tokens, pos))
        if not found:
            return []
        longest = max(m for m, _, _ in found)
        best = [f for f in found if f[0] == longest]
        out = [follow(best, longest, min(limit, longest + SPEC_OFFSET))]
        if len(best) < len(found):
            shortest = min(m for m, _, _ in found)
            out.append(follow(found, shortest, min(limit, shortest + SPEC_OFFSET)))
        return [p for p in out if p.tokens]


def follow(found: list[tuple[int, list[int], int]], match: int, limit: int) -> Path:
    """The continuation the most of `found` share, token by token, while at least MIN_SHARE of them agree (ties go to
    the newest occurrence, first in `found`)."""
    path = Path(match, pos=found[0][2])
    if len(found) == 1:  # one occurrence: its text as it goes on
        _, tokens, pos = found[0]
        path.tokens = tokens[pos : pos + limit]
        path.shares = [1.0] * len(path.tokens)
        return path
    live = [(tokens, pos) for _, tokens, pos in found]
    share = 1.0
    for i in range(limit):
        nexts = [tokens[pos + i] if pos + i < len(tokens) else -1 for tokens, pos in live]  # -1: that one has ended
        token = nexts[0]
        agree = nexts.count(token)
        if token < 0 or agree < len(nexts):  # they differ: the most common (ties: the newest)
            counts: dict[int, int] = {}
            for t in nexts:
                if t >= 0:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            agree = counts[token]
        share *= agree / len(live)
        if share < MIN_SHARE:
            break
        path.tokens.append(token)
        path.shares.append(share)
        if agree < len(live):
            live = [occurrence for occurrence, t in zip(live, nexts, strict=True) if t == token]
    return path
