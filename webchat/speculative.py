"""Drafters for speculative decoding: a draft model, a self-draft (first layers of the main model), n-gram lookup.

A drafter proposes up to k tokens that continue `context`; the generator verifies them with the main model in one
forward and keeps only those equal to the main model's own choice (see webchat.generator), so a drafter can change
speed, never output. Drafting is greedy and uses no randomness.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from webchat.cache import KVCache

MODES = ("none", "self", "ngram", "draft")  # in the order the page and the CLIs list them


class DraftVocabError(ValueError):
    """The draft model does not share the main model's vocabulary."""


class Drafter(Protocol):
    def draft(self, context: list[int], k: int) -> list[int]:
        """Up to k token ids likely to follow context (prompt + reply so far)."""
        ...


def check_vocab(main: Any, draft: Any, main_tok: Any = None, draft_tok: Any = None) -> None:
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


class ModelDrafter:
    """Greedy drafts from a model with its own KV cache, kept in step with the context by longest common prefix.

    Drafting stops early when the draft's top probability falls under `min_prob` (exllamav2 uses 0.25).
    """

    def __init__(self, model: Any, capacity: int, min_prob: float = 0.0, chunk: int = 256) -> None:
        self.model = model
        self.cache: KVCache = model.new_cache(capacity)
        self.ids: list[int] = []  # tokens whose k/v are in self.cache
        self.min_prob = min_prob
        self.chunk = chunk

    def _sync(self, context: list[int]) -> None:
        """Rewind the cache to the prefix shared with context (rejected drafts go), feed all but its last token."""
        n = common_prefix(self.ids, context)
        n = min(n, len(context) - 1)
        self.cache.truncate(n)
        del self.ids[n:]
        todo = context[n:-1]
        for i in range(0, len(todo), self.chunk):
            self._feed(todo[i : i + self.chunk])

    def _feed(self, ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor(ids, device=self.model.device), self.cache, last_only=True)
        self.ids.extend(ids)
        return logits[-1]  # type: ignore[no-any-return]

    def draft(self, context: list[int], k: int) -> list[int]:
        k = min(k, self.cache.capacity - len(context))
        if k <= 0:
            return []
        self._sync(context)
        out: list[int] = []
        last = context[-1]
        for _ in range(k):
            logits = self._feed([last])  # (vocab,)
            last = int(torch.argmax(logits))
            if self.min_prob > 0.0 and float(torch.softmax(logits, -1)[last]) < self.min_prob:
                break
            out.append(last)
        return out


class SelfDrafter(ModelDrafter):
    """The main model's first n layers plus its norm and head; its cache shares those layers' k/v with the main cache.

    The first n layers compute the same k/v for the same tokens, so the context never needs a second prefill: the
    draft writes only at positions past the main cache's length, which the verifying forward then overwrites.
    """

    def __init__(self, model: Any, n_layers: int, main_cache: KVCache, min_prob: float = 0.0) -> None:
        self.model = model.truncated(n_layers)
        self.main_cache = main_cache
        view = KVCache.__new__(KVCache)
        view.k, view.v = main_cache.k[:n_layers], main_cache.v[:n_layers]
        view.capacity, view.length = main_cache.capacity, 0
        self.cache = view
        self.ids = []
        self.min_prob = min_prob
        self.chunk = 256

    def _sync(self, context: list[int]) -> None:
        n = self.main_cache.length
        if n >= len(context):
            raise ValueError(f"self-draft needs the context past the main cache: context {len(context)}, cache {n}")
        self.cache.length = n
        self.ids = list(context[:n])
        if len(context) - 1 > n:
            self._feed(context[n:-1])


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
