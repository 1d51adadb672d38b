"""Fitting a long conversation into the context: the oldest turns are left out, the system prompt and the latest
user message never are.

    messages = [system?] + history + [latest user]
    keep [system?] + history[k:] + [latest user], k the smallest drop (history[k] a user turn, or k = len(history))
    with len(encode(kept)) <= budget;  budget = context - max_new_tokens
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Fitted:
    ids: list[int]
    dropped: int  # messages left out, oldest first
    fits: bool  # False: even the system prompt and the latest message alone exceed the budget (ids: those two)


def fit_history(encode: Callable[[list[dict[str, Any]]], list[int]], messages: list[dict[str, Any]],
                budget: int) -> Fitted:  # fmt: skip
    """The longest suffix of the history that fits `budget` tokens, by binary search (about log2(n) encodes)."""
    ids = encode(messages)
    if len(ids) <= budget:
        return Fitted(ids, 0, True)
    head = _head(messages)
    history = messages[head:-1]
    # drops that start the kept history on a user turn (templates may require user/assistant alternation)
    drops = [k for k in range(1, len(history)) if history[k].get("role") == "user"] + [len(history)]
    lo, hi = 0, len(drops) - 1
    best: Fitted | None = None
    while lo <= hi:  # the kept prompt shrinks as the drop grows: find the smallest drop that fits
        mid = (lo + hi) // 2
        k = drops[mid]
        ids = encode(kept_messages(messages, k))
        if len(ids) <= budget:
            best, hi = Fitted(ids, k, True), mid - 1
        else:
            lo = mid + 1
    if best is not None:
        return best
    k = len(history)
    return Fitted(encode(kept_messages(messages, k)), k, False)


def _head(messages: list[dict[str, Any]]) -> int:
    return 1 if messages and messages[0].get("role") == "system" and len(messages) > 1 else 0


def kept_messages(messages: list[dict[str, Any]], dropped: int) -> list[dict[str, Any]]:
    """The messages a fit keeps when `dropped` (Fitted.dropped) of the oldest were left out."""
    if not dropped:
        return messages
    head = _head(messages)
    return messages[:head] + messages[head + dropped : -1] + messages[-1:]
