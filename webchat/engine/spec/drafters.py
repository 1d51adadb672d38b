"""Drafters for speculative decoding: a draft model, a self-draft (first layers of the main model), n-gram lookup.

A drafter proposes up to k tokens that continue `context`; the engine verifies them with the main model in one
forward and keeps only those equal to the main model's own choice (webchat.engine.engine, Engine._verify), so a
drafter can change speed, never output. Drafting is greedy and uses no randomness.
"""

from __future__ import annotations

from typing import Protocol

import torch

from webchat.model.batch import Batch, make_batch
from webchat.model.config import ModelArgs
from webchat.model.kv_cache import KVPool, PageTable, PoolExhausted, SeqCache

MODES = ("auto", "none", "self", "ngram", "draft")  # in the order the page and the CLIs list them


class DraftVocabError(ValueError):
    """The draft model does not share the main model's vocabulary."""


class Drafting(Protocol):
    """What a drafter reads of a sequence (webchat.engine.sequence.Sequence)."""

    tokens: list[int]  # prompt + reply so far; the last one pending (sampled, not yet fed)
    n_cached: int  # tokens whose k/v are in `table`
    table: PageTable


class Drafter(Protocol):
    """Drafts for the fixed modes (self, ngram, draft): the engine asks for them, never which drafter it has."""

    def propose(self, seq: Drafting, k: int) -> list[int]:
        """Up to k token ids likely to follow seq.tokens."""
        ...


class VocabTokenizer(Protocol):
    vocab_size: int

    def token_bytes(self, token_id: int) -> bytes: ...


def check_vocab(main: DraftModel, draft: DraftModel, main_tok: VocabTokenizer | None = None,
                draft_tok: VocabTokenizer | None = None) -> None:
    """Raise DraftVocabError unless the two models (and tokenizers, when given) have the same vocabulary."""
    mv, dv = main.args.vocab_size, draft.args.vocab_size
    if mv != dv:
        raise DraftVocabError(f"draft model vocabulary has {dv} tokens; the main model has {mv}: they must match")
    if main_tok is None or draft_tok is None:
        return
    if main_tok.vocab_size != draft_tok.vocab_size:
        raise DraftVocabError(
            f"draft tokenizer has {draft_tok.vocab_size} tokens; the main tokenizer has {main_tok.vocab_size}"
        )
    for i in range(main_tok.vocab_size):
        a, b = main_tok.token_bytes(i), draft_tok.token_bytes(i)
        if a != b:
            raise DraftVocabError(f"token {i} is {a!r} in the main tokenizer but {b!r} in the draft tokenizer")


class DraftModel(Protocol):
    """What a drafter needs of a model: the paged forward, its shape, a pool and a truncated copy."""

    args: ModelArgs

    def __call__(self, batch: Batch, kv: KVPool) -> torch.Tensor: ...
    def new_pool(self, n_tokens: int, page_size: int | None = None) -> KVPool: ...
    def ensure_rope(self, n_positions: int) -> None: ...
    def truncated(self, n_layers: int) -> DraftModel: ...


class ModelDrafter:
    """Greedy drafts from a model with a cache of its own, kept in step with the context by longest common prefix."""

    def __init__(self, model: DraftModel, capacity: int, chunk: int = 256) -> None:
        self.model = model
        self.cache = SeqCache(model.new_pool(capacity))
        self.chunk = chunk

    def _sync(self, context: list[int]) -> None:
        """Rewind the cache to the prefix shared with context (rejected drafts go), feed all but its last token."""
        n = min(common_prefix(self.cache.ids, context), len(context) - 1)
        self.cache.truncate(n)
        todo = context[n:-1]
        for i in range(0, len(todo), self.chunk):
            self.cache.feed(self.model, todo[i : i + self.chunk])

    def propose(self, seq: Drafting, k: int) -> list[int]:
        return self.draft(seq.tokens, k)[:k]

    def draft(self, context: list[int], k: int) -> list[int]:
        k = min(k, self.cache.capacity - len(context))
        if k <= 0:
            return []
        self._sync(context)
        out: list[int] = []
        last = context[-1]
        for _ in range(k):
            logits = self.cache.feed(self.model, [last])[-1]  # (vocab,)
            last = int(torch.argmax(logits))
            out.append(last)
        return out


class SelfDrafter:
    """The main model's first n layers plus its norm and head, drafting on the sequence's own pages.

    The first n layers compute the same k/v for the same tokens, so the context never needs a second prefill: the
    draft writes only at positions >= n_cached (pages the sequence holds alone), which the verifying forward then
    overwrites.
    """

    def __init__(self, model: DraftModel, n_layers: int, pool: KVPool) -> None:
        self.model = model.truncated(n_layers)
        self.pool = pool

    def propose(self, seq: Drafting, k: int) -> list[int]:
        """Drafts on the sequence's own pages (none where the pool has no room for them: drafts change speed, never
        output)."""
        try:
            seq.table.ensure(seq.n_cached + k + 1)
        except PoolExhausted:
            return []
        return self.draft_at(seq.tokens, k, seq.table.pages, seq.n_cached)[:k]

    def draft_at(self, context: list[int], k: int, pages: list[int], n_cached: int) -> list[int]:
        """Up to k drafts after context, whose first n_cached tokens are in `pages` (enough for len(context) + k)."""
        if n_cached >= len(context):
            raise ValueError(f"self-draft needs the context past the cache: context {len(context)}, cache {n_cached}")
        ps, device = self.pool.page_size, self.pool.k[0].device
        feed, start, out = context[n_cached:], n_cached, []
        for _ in range(k):
            batch = make_batch([(feed, start, pages, [-1])], ps, device)
            logits = self.model(batch, self.pool)[-1]  # (vocab,)
            start += len(feed)
            last = int(torch.argmax(logits))
            out.append(last)
            feed = [last]
        return out


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n = max_n..1), propose what
    followed it. Index: n-gram -> position just after its latest occurrence, built incrementally."""

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n
        self.ids: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def _extend(self, context: list[int]) -> None:
        if context[: len(self.ids)] != self.ids:
            self.ids, self.index = [], {}
        for j in range(len(self.ids), len(context)):
            # n-grams ending just before j, pointing at j (so every entry has a continuation)
            for n in range(1, self.max_n + 1):
                if j - n >= 0:
                    self.index[tuple(context[j - n : j])] = j
        self.ids = list(context)

    def propose(self, seq: Drafting, k: int) -> list[int]:
        return self.draft(seq.tokens, k)[:k]

    def draft(self, context: list[int], k: int) -> list[int]:
        if k <= 0 or not context:
            return []
        self._extend(context)
        for n in range(min(self.max_n, len(context)), 0, -1):
            j = self.index.get(tuple(context[-n:]))
            if j is not None:
                return context[j : j + k]
        return []


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading items a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
